# cython: language_level=3
"""TaskDescriptor, one collective as the daemon runs it (the constants and
hashes it is built from are dfccl._native.layout's)."""

from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memset
from cpython.ref cimport PyObject

from dfccl._native.abi cimport *

from dfccl.errors import InvalidArgumentError


cdef class TaskDescriptor:
    """One collective as the daemon runs it: a dfccl_task_desc (abi.h) less
    what each instance adds (slot, generation, instance number, tag record,
    staging), plus what the host needs to name and retire it.  Built once per
    bound plan, or once per plain call's shape; the daemon turns it into a
    running instance (hotpath.pyx).  Its plan (core.pxd, plan_t) is what the
    C API submits: it lives as long as this object."""

    def __init__(self, *, str kind, object tag, int rank, uint64_t key, bint transient, TagTable tags,
                 uint32_t endpoint, int kind_code, int dtype, int op, int path, int root, int nchannels,
                 uint64_t send_addr, uint64_t recv_addr, uint64_t count, uint32_t slice_bytes=0,
                 uint32_t fifo_slots=0, uint32_t flags=0, uint64_t staging_bytes=0, object stream=None,
                 object owners=None, uint64_t send_reg=0, uint64_t aux_offset=0, uint64_t aux_bytes=0,
                 object flight=None, int64_t block_offset=-1):
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
        # Where channel 0 runs, past the tag's hash: the communicator sets it
        # so that its ranks sharing a daemon use disjoint blocks; by default
        # the endpoint index.
        self.plan.block_offset = endpoint if block_offset < 0 else <uint32_t>block_offset
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
