from typing import Any, Callable

from dfccl._native.backend import Backend
from dfccl._native.work import Work

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
TASK_LL: int
MAX_CHANNELS: int
MAX_RANKS: int
RECORD_HEADER_BYTES: int
CHAN_INSTANCE_OFFSET: int
CHAN_STATE_BYTES: int

# The daemon's hashes (cuda/include/dfccl/hash.h), on the low 64 bits of their arguments.
def mix64(x: int) -> int: ...
def home_bucket(key: int, capacity: int) -> int: ...
def instance_token(key: int, instance: int) -> int: ...
def first_block(key: int, endpoint: int, nblocks: int) -> int: ...

class Context:
    backend: Backend
    nblocks: int
    nslots: int
    max_endpoints: int
    link_block: bool
    mapped_dev: int
    done_dev: int
    epoch: int
    policy: Any
    closed: bool
    forked_from: int
    relaunch_backoff_ns: int
    launches: int
    def __init__(self, backend: Backend, *, blocks: int, slots: int, max_endpoints: int, policy: Any,
                 link_ahead: int = 0, link_block: bool = False) -> None: ...
    def add_endpoint(self, rank: int, nranks: int, table_capacity: int, record_stride: int, comm_key: int,
                     peer_tables: list[int], peer_arenas: list[int], reg_table: int = 0, ll_offset: int = 0,
                     ll_max_bytes: int = 0) -> int: ...
    def remove_endpoint(self, idx: int, on_released: Callable[[], None] | None = None) -> bool: ...
    def reclaim_endpoints(self) -> int: ...
    def forget_after_fork(self, parent_pid: int) -> None: ...
    @property
    def draining(self) -> list[int]: ...
    def endpoint_entry(self, idx: int) -> tuple[int, int]: ...
    def abort_endpoint(self, idx: int, lost_rank: int = -1) -> None: ...
    def abandon(self, work: Work) -> bool: ...
    @property
    def bad_tasks(self) -> int: ...
    diagnostics: dict[int, object]
    def submit(self, task: Any, raw_fields: dict[str, int] | None = None) -> Work: ...
    def submit_at(self, task: Any, send_addr: int, recv_addr: int, stream: int | None, owners: object) -> Work: ...
    @property
    def outstanding_count(self) -> int: ...
    @property
    def submissions(self) -> tuple[int, int]: ...
    @property
    def daemon_state(self) -> tuple[int, str]: ...
    @property
    def stream_waits(self) -> int: ...
    def held_by_daemon(self, endpoint: int) -> int: ...
    def stream_reached(self, work: Work, timeout: float = 0.5) -> bool | None: ...
    def daemon_profile(self) -> list[dict[str, int]]: ...
    def daemon_sms(self) -> list[int | None]: ...
    def close(self, timeout: float = 10.0) -> None: ...
