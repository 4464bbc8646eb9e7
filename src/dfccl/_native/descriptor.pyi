from typing import Any

from dfccl._native.tag_table import TagTable

STATUS_OK: int
STATUS_MISMATCH: int
STATUS_PEER_ABORTED: int
STATUS_ABORTED: int
STATUS_BAD_TASK: int
STATUS_PEER_LOST: int
NUM_KINDS: int
NUM_DTYPES: int
NUM_OPS: int
NUM_PATHS: int
ARENA_STATUS_BYTES: int
RANK_LIVE: int
RANK_ABORTED: int
RANK_CLOSED: int
RANK_FAILED: int
KIND_ALL_REDUCE: int
KIND_ALL_GATHER: int
KIND_REDUCE_SCATTER: int
KIND_BROADCAST: int
KIND_REDUCE: int
KIND_SEND: int
KIND_RECV: int
KIND_ALL_TO_ALL: int
PATH_DIRECT: int
PATH_RING: int
TASK_ONE_SHOT: int
TASK_STAGED: int
TASK_LL: int
MAX_CHANNELS: int
MAX_RANKS: int
RECORD_HEADER_BYTES: int
FIFO_OFFSET_MASK: int
FIFO_UNIT_SHIFT: int
FIFO_UNIT_BYTES: int
FIFO_UNIT_MAX: int
FIFO_SLOTS_SHIFT: int
FIFO_SLOTS_MAX: int
CHAN_INSTANCE_OFFSET: int
CHAN_STATE_BYTES: int

# The daemon's hashes (cuda/include/dfccl/hash.h), on the low 64 bits of their arguments.
def mix64(x: int) -> int: ...
def home_bucket(key: int, capacity: int) -> int: ...
def instance_token(key: int, instance: int) -> int: ...
def first_block(key: int, endpoint: int, nblocks: int) -> int: ...

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
                 send_reg: int = 0, aux_offset: int = 0, aux_bytes: int = 0, flight: Any = None) -> None: ...
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
