"""The daemon's ABI constants, hashes and layout formulas (cuda/include/dfccl/abi.h, hash.h, layout.h)."""

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
RECORD_BYTES: int
OWNER_BUCKET_BYTES: int
FIFO_OFFSET_MASK: int
FIFO_UNIT_SHIFT: int
FIFO_UNIT_BYTES: int
FIFO_UNIT_MAX: int
FIFO_SLOTS_SHIFT: int
FIFO_SLOTS_MAX: int
CHAN_INSTANCE_OFFSET: int
CHAN_STATE_BYTES: int
DTYPE_INT8: int
DTYPE_UINT8: int
DTYPE_INT32: int
DTYPE_UINT32: int
DTYPE_INT64: int
DTYPE_UINT64: int
DTYPE_FLOAT16: int
DTYPE_FLOAT32: int
DTYPE_FLOAT64: int
DTYPE_BFLOAT16: int
OP_SUM: int
OP_PROD: int
OP_MIN: int
OP_MAX: int
OP_AVG: int
PEER_CACHE: int
LINK_AHEAD_MAX: int
TASK_SEND_REGISTERED: int
REG_SLOTS: int
REG_SLOT_SHIFT: int
REG_BIT: int
STAGE_ALIGN: int
LL_HEADER_LINES: int
LL_LINE_BYTES: int
LL_LINE_PAYLOAD: int
LL_MAX_RANKS: int
LL_DEFAULT_MAX_BYTES: int

# The daemon's hashes (cuda/include/dfccl/hash.h), on the low 64 bits of their arguments.
def mix64(x: int) -> int: ...
def home_bucket(key: int, capacity: int) -> int: ...
def instance_token(key: int, instance: int) -> int: ...
def first_block(key: int, offset: int, nblocks: int) -> int: ...

# Layout formulas (cuda/include/dfccl/layout.h).
def dtype_size(dtype: int) -> int: ...
def ll_area_bytes(ll_max_bytes: int) -> int: ...
def ll_region_bytes(capacity: int, nranks: int, ll_max_bytes: int) -> int: ...
def a2a_words(nranks: int, nchannels: int) -> int: ...
def a2a_copy_offset(nranks: int, nchannels: int) -> int: ...
