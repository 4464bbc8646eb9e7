# cython: language_level=3
"""The daemon's ABI for Python, from the C headers themselves: the constants
of abi.h and layout.h, the hashes of hash.h and the layout formulas of
layout.h (cuda/include/dfccl/).  The one place planning-level modules take
a code, a size or a hash from; it depends on nothing else in dfccl, so
they need not import the runtime."""

from libc.stdint cimport uint32_t, uint64_t

from dfccl._native.abi cimport *

# Status codes of dfccl_result (abi.h), for Python.
STATUS_OK = DFCCL_STATUS_OK
STATUS_MISMATCH = DFCCL_STATUS_MISMATCH
STATUS_PEER_ABORTED = DFCCL_STATUS_PEER_ABORTED
STATUS_ABORTED = DFCCL_STATUS_ABORTED
STATUS_BAD_TASK = DFCCL_STATUS_BAD_TASK
STATUS_PEER_LOST = DFCCL_STATUS_PEER_LOST
NUM_KINDS = DFCCL_NUM_KINDS
NUM_DTYPES = DFCCL_NUM_DTYPES
NUM_OPS = DFCCL_NUM_OPS
NUM_PATHS = DFCCL_NUM_PATHS
# The rank status at the start of every arena (abi.h, dfccl_rank_status).
ARENA_STATUS_BYTES = DFCCL_ARENA_STATUS_BYTES
RANK_LIVE = DFCCL_RANK_LIVE
RANK_ABORTED = DFCCL_RANK_ABORTED
RANK_CLOSED = DFCCL_RANK_CLOSED
RANK_FAILED = DFCCL_RANK_FAILED

KIND_ALL_REDUCE = DFCCL_ALL_REDUCE
KIND_ALL_GATHER = DFCCL_ALL_GATHER
KIND_REDUCE_SCATTER = DFCCL_REDUCE_SCATTER
KIND_BROADCAST = DFCCL_BROADCAST
KIND_REDUCE = DFCCL_REDUCE
KIND_SEND = DFCCL_SEND
KIND_RECV = DFCCL_RECV
KIND_ALL_TO_ALL = DFCCL_ALL_TO_ALL
PATH_DIRECT = DFCCL_PATH_DIRECT
PATH_RING = DFCCL_PATH_RING
TASK_ONE_SHOT = DFCCL_TASK_ONE_SHOT
TASK_STAGED = DFCCL_TASK_STAGED
TASK_LL = DFCCL_TASK_LL
MAX_CHANNELS = DFCCL_MAX_CHANNELS
MAX_RANKS = DFCCL_MAX_RANKS
RECORD_HEADER_BYTES = DFCCL_RECORD_HEADER_BYTES
RECORD_BYTES = DFCCL_RECORD_BYTES
OWNER_BUCKET_BYTES = DFCCL_OWNER_BUCKET_BYTES
# The shape bits of a fifo word (abi.h, DFCCL_FIFO_*).
FIFO_OFFSET_MASK = DFCCL_FIFO_OFFSET_MASK
FIFO_UNIT_SHIFT = DFCCL_FIFO_UNIT_SHIFT
FIFO_UNIT_BYTES = DFCCL_FIFO_UNIT_BYTES
FIFO_UNIT_MAX = DFCCL_FIFO_UNIT_MAX
FIFO_SLOTS_SHIFT = DFCCL_FIFO_SLOTS_SHIFT
FIFO_SLOTS_MAX = DFCCL_FIFO_SLOTS_MAX


cdef size_t _chan_instance_offset():
    cdef dfccl_chan_state cs
    return <size_t>(<char *>&cs.instance - <char *>&cs)


# Where a channel state names the instance it published (host diagnostics
# probe as the daemon does).
CHAN_INSTANCE_OFFSET = _chan_instance_offset()
CHAN_STATE_BYTES = sizeof(dfccl_chan_state)


_MASK64 = (1 << 64) - 1


# The daemon's hashes (dfccl/hash.h) from the same C, for Python; they work
# on the low 64 bits of their arguments, like the C.
def mix64(x):
    """splitmix64's finaliser."""
    return dfccl_mix64(<uint64_t>(x & _MASK64))


def home_bucket(key, uint32_t capacity):
    """Where probing for a tag's record starts."""
    if capacity == 0:
        raise ValueError("capacity must be positive")
    return dfccl_home_bucket(<uint64_t>(key & _MASK64), capacity)


def instance_token(key, instance):
    """The daemon's name of one instance of a tag."""
    return dfccl_instance_token(<uint64_t>(key & _MASK64), <uint64_t>(instance & _MASK64))


def first_block(key, uint32_t offset, uint32_t nblocks):
    """The daemon block that runs channel 0 of the tag's instances on a rank
    whose block offset is ``offset`` (dfccl/hash.h; set when a descriptor is
    bound to its daemon)."""
    if nblocks == 0:
        raise ValueError("nblocks must be positive")
    return dfccl_first_block(<uint64_t>(key & _MASK64), offset, nblocks)


# Element types (dfccl_dtype) and reductions (dfccl_op): dfccl.types builds
# its enums from these.
DTYPE_INT8 = DFCCL_INT8
DTYPE_UINT8 = DFCCL_UINT8
DTYPE_INT32 = DFCCL_INT32
DTYPE_UINT32 = DFCCL_UINT32
DTYPE_INT64 = DFCCL_INT64
DTYPE_UINT64 = DFCCL_UINT64
DTYPE_FLOAT16 = DFCCL_FLOAT16
DTYPE_FLOAT32 = DFCCL_FLOAT32
DTYPE_FLOAT64 = DFCCL_FLOAT64
DTYPE_BFLOAT16 = DFCCL_BFLOAT16
OP_SUM = DFCCL_SUM
OP_PROD = DFCCL_PROD
OP_MIN = DFCCL_MIN
OP_MAX = DFCCL_MAX
OP_AVG = DFCCL_AVG
PEER_CACHE = DFCCL_PEER_CACHE
LINK_AHEAD_MAX = DFCCL_LINK_AHEAD_MAX
# Registered buffers (abi.h, "registered buffers"): a staged send names its
# input as REG_BIT | slot << REG_SLOT_SHIFT | offset.
TASK_SEND_REGISTERED = DFCCL_TASK_SEND_REGISTERED
REG_SLOTS = DFCCL_REG_SLOTS
REG_SLOT_SHIFT = DFCCL_REG_SLOT_SHIFT
REG_BIT = DFCCL_REG_BIT
# layout.h.
STAGE_ALIGN = DFCCL_STAGE_ALIGN
LL_HEADER_LINES = DFCCL_LL_HEADER_LINES
LL_LINE_BYTES = DFCCL_LL_LINE_BYTES
LL_LINE_PAYLOAD = DFCCL_LL_LINE_PAYLOAD
LL_MAX_RANKS = DFCCL_LL_MAX_RANKS
LL_DEFAULT_MAX_BYTES = DFCCL_LL_DEFAULT_MAX_BYTES


def dtype_size(int dtype):
    """Bytes of one element of a dtype code."""
    if not 0 <= dtype < DFCCL_NUM_DTYPES:
        raise ValueError(f"no dtype code {dtype}")
    return dfccl_dtype_size(dtype)


def ll_area_bytes(uint64_t ll_max_bytes):
    """Bytes of one LL area: its header lines, then a line per 8 payload bytes."""
    return dfccl_ll_area_bytes(ll_max_bytes)


def ll_region_bytes(uint32_t capacity, uint32_t nranks, uint64_t ll_max_bytes):
    """Bytes of the LL region of one rank's arena: receive areas
    [bucket][sender][parity], then acks [bucket][receiver] (0 without LL)."""
    return dfccl_ll_region_bytes(capacity, nranks, ll_max_bytes)


def a2a_words(uint32_t nranks, uint32_t nchannels):
    """Words of an all-to-all split table."""
    return dfccl_a2a_words(nranks, nchannels)


def a2a_copy_offset(uint32_t nranks, uint32_t nchannels):
    """Where an all-to-all's send copy starts after its split table."""
    return dfccl_a2a_copy_offset(nranks, nchannels)
