# cython: language_level=3
"""The descriptor and ABI layer of the host runtime: the constants of
cuda/include/dfccl/abi.h for Python, the daemon's hashes (hash.h) from the
same C, and TaskDescriptor, one collective as the daemon runs it."""

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memset
from cpython.ref cimport PyObject

from dfccl._native.abi cimport *

from dfccl.errors import InvalidArgumentError

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


def first_block(key, uint32_t endpoint, uint32_t nblocks):
    """The daemon block that runs channel 0 of the tag's instances on the
    endpoint (dfccl/hash.h; set when a descriptor is bound to its context)."""
    if nblocks == 0:
        raise ValueError("nblocks must be positive")
    return dfccl_first_block(<uint64_t>(key & _MASK64), endpoint, nblocks)


cdef class TaskDescriptor:
    """One collective as the daemon runs it: a dfccl_task_desc (abi.h) less
    what each instance adds (slot, generation, instance number, tag record,
    staging), plus what the host needs to name and retire it.  Built once per
    bound plan, or once per plain call's shape; the context turns it into a
    running instance (hotpath.pyx).  Its plan (core.pxd, plan_t) is what the
    C API submits: it lives as long as this object."""

    def __init__(self, *, str kind, object tag, int rank, uint64_t key, bint transient, TagTable tags,
                 uint32_t endpoint, int kind_code, int dtype, int op, int path, int root, int nchannels,
                 uint64_t send_addr, uint64_t recv_addr, uint64_t count, uint32_t slice_bytes=0,
                 uint32_t fifo_slots=0, uint32_t flags=0, uint64_t staging_bytes=0, object stream=None,
                 object owners=None, uint64_t send_reg=0, uint64_t aux_offset=0, uint64_t aux_bytes=0,
                 object flight=None):
        cdef dfccl_task_desc *d = &self.plan.desc
        memset(&self.plan, 0, sizeof(self.plan))
        d.send_reg = send_reg
        d.send_addr = send_addr
        d.recv_addr = recv_addr
        d.count = count
        d.tag_key = key
        d.endpoint = endpoint
        d.slice_bytes = slice_bytes
        d.fifo_slots = fifo_slots
        d.flags = flags
        d.root = root
        d.nchannels = nchannels
        d.kind = kind_code
        d.dtype = dtype
        d.op = op
        d.path = path
        d.aux_offset = aux_offset
        self.kind = kind
        self.tag = tag
        self.rank = rank
        self.key = key
        self.transient = transient
        self.tags = tags
        self.staging_bytes = staging_bytes
        self.owners = owners
        # Where each submission is recorded (flight.py, FlightRecorder.ring).
        self.flight = flight
        self.plan.descriptor = <PyObject *>self
        self.plan.tags = tags.t
        self.plan.key = key
        self.plan.transient = transient
        self.plan.staging_bytes = staging_bytes
        self.plan.has_stream = stream is not None
        self.plan.stream = 0 if stream is None else <uint64_t>stream
        # Staging this instance has alone (an all-to-all's split table): the
        # tag table takes it back when the instance retires.
        self.plan.aux_offset = aux_offset
        self.plan.aux_bytes = aux_bytes
        # How the channels use the tag's staging (tag_table.pyx, _take).
        self.plan.has_layout = staging_bytes != 0
        self.plan.layout.w[0] = count
        self.plan.layout.w[1] = (<uint64_t>kind_code | (<uint64_t>dtype << 8) | (<uint64_t>path << 16)
                                 | (<uint64_t>(send_reg != 0) << 24) | (<uint64_t>nchannels << 32))
        self.plan.layout.w[2] = <uint64_t>flags | (<uint64_t>slice_bytes << 32)
        self.plan.layout.w[3] = fifo_slots

    @property
    def nchannels(self):
        return self.plan.desc.nchannels

    @property
    def count(self):
        return self.plan.desc.count

    @property
    def dtype(self):
        return self.plan.desc.dtype

    @property
    def path(self):
        return self.plan.desc.path

    @property
    def flags(self):
        return self.plan.desc.flags

    def __repr__(self):
        return f"<dfccl.TaskDescriptor {self.kind} tag={self.tag!r} rank={self.rank} count={self.plan.desc.count}>"


cdef int override_fields(void *desc, dict fields) except -1:
    """Tests only: writes named descriptor fields as given (no checks)."""
    cdef dfccl_task_desc *d = <dfccl_task_desc *>desc
    for name, value in fields.items():
        if name == "kind": d.kind = <uint8_t>value
        elif name == "dtype": d.dtype = <uint8_t>value
        elif name == "op": d.op = <uint8_t>value
        elif name == "path": d.path = <uint8_t>value
        elif name == "nchannels": d.nchannels = <uint16_t>value
        elif name == "root": d.root = <uint16_t>value
        elif name == "endpoint": d.endpoint = <uint32_t>value
        elif name == "bucket": d.bucket = <uint32_t>value
        elif name == "slot": d.slot = <uint32_t>value
        elif name == "instance": d.instance = <uint64_t>value
        elif name == "slice_bytes": d.slice_bytes = <uint32_t>value
        elif name == "fifo_slots": d.fifo_slots = <uint32_t>value
        elif name == "count": d.count = <uint64_t>value
        elif name == "first_block": d.first_block = <uint32_t>value
        else:
            raise InvalidArgumentError(f"raw descriptor field {name!r} is not one a test may set")
    return 0
