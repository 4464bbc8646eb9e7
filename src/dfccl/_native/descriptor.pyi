from typing import Any

from dfccl._native.tag_table import TagTable

class TaskDescriptor:
    kind: str
    tag: object
    rank: int
    key: int
    transient: bool
    staging_bytes: int
    owners: object
    def __init__(self, *, kind: str, tag: object, rank: int, key: int, transient: bool, tags: TagTable,
                 endpoint: int, kind_code: int, dtype: int, op: int, path: int, root: int, nchannels: int,
                 send_addr: int, recv_addr: int, count: int, slice_bytes: int = 0, fifo_slots: int = 0,
                 flags: int = 0, staging_bytes: int = 0, stream: int | None = None, owners: object = None,
                 send_reg: int = 0, aux_offset: int = 0, aux_bytes: int = 0, flight: Any = None,
                 block_offset: int = -1) -> None: ...
    @property
    def nchannels(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def dtype(self) -> int: ...
    @property
    def path(self) -> int: ...
    @property
    def flags(self) -> int: ...
