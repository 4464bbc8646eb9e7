# cython: language_level=3
"""The C API: the table of cuda/include/dfccl/dfccl_api.h, handed out in
a PyCapsule named DFCCL_API_CAPSULE (the module attribute ``api``, or
``api_capsule()``).  Its entries are thin shells over the hot path
(hotpath.pyx submits, completion.pyx tests, waits and releases), the same
functions the Python layer calls: a C caller gets exactly the Python layer's submissions, retirements and errors, with no
Python object per collective.

Threading: any thread may call; a caller that holds the GIL gives it up
for the call (the locks below may be held by a thread that needs it).
Only the rare paths take it (hotpath.pyx and completion.pyx say which)."""

from cpython.pycapsule cimport PyCapsule_New
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

from dfccl._native.abi cimport *
from dfccl._native.core cimport daemon_core, plan_t
from dfccl._native.completion cimport handle_release, handle_stream_wait, handle_test, handle_wait
from dfccl._native.hotpath cimport submit, submitted_t
from dfccl._native.launch cimport core_incref, last_error_message, record_error

from dfccl.errors import InvalidArgumentError

cdef extern from "Python.h":
    ctypedef struct PyThreadState:
        pass
    int PyGILState_Check() nogil
    PyThreadState *PyEval_SaveThread() nogil
    void PyEval_RestoreThread(PyThreadState *state) nogil


cdef inline PyThreadState *_let_go() noexcept nogil:
    return PyEval_SaveThread() if PyGILState_Check() else NULL


cdef inline void _take_back(PyThreadState *state) noexcept nogil:
    if state != NULL:
        PyEval_RestoreThread(state)


cdef int _invalid(const char *what) noexcept with gil:
    return record_error(InvalidArgumentError(what.decode()))


cdef int _submit(const dfccl_plan *plan, const dfccl_submit_at *at, dfccl_handle *out) noexcept nogil:
    cdef plan_t *p = <plan_t *>plan
    cdef submitted_t s
    cdef PyThreadState *state
    cdef int rc
    if out == NULL:
        return _invalid(b"submit: out is NULL")
    out.context = NULL
    out.slot = 0
    out.gen = 0
    if p == NULL or p.core == NULL:
        return _invalid(b"submit: the plan is NULL or was never handed out (BoundPlan.c_plan binds it)")
    state = _let_go()
    if at == NULL:
        rc = submit(p.core, p, p.desc.send_addr, p.desc.recv_addr, p.has_stream, p.stream, False, NULL, &s)
    else:
        rc = submit(p.core, p, at.send_addr, at.recv_addr, at.has_stream != 0, at.stream, False, NULL, &s)
    if s.gen != 0:
        # The handle keeps the daemon's C state (not the Daemon) alive.
        core_incref(p.core)
        out.context = p.core
        out.slot = s.slot
        out.gen = s.gen
    _take_back(state)
    return rc


cdef int _test(const dfccl_handle *h, uint32_t *status, int32_t *detail) noexcept nogil:
    cdef PyThreadState *state
    cdef int rc
    if h == NULL or h.context == NULL:
        return _invalid(b"test: the handle is NULL or released")
    state = _let_go()
    rc = handle_test(<daemon_core *>h.context, h.slot, h.gen, status, detail)
    _take_back(state)
    return rc


cdef int _wait(const dfccl_handle *h, int64_t timeout_ns, uint32_t *status, int32_t *detail) noexcept nogil:
    cdef PyThreadState *state
    cdef int rc
    if h == NULL or h.context == NULL:
        return _invalid(b"wait: the handle is NULL or released")
    state = _let_go()
    rc = handle_wait(<daemon_core *>h.context, h.slot, h.gen, timeout_ns, status, detail)
    _take_back(state)
    return rc


cdef int _stream_wait(const dfccl_handle *h, uint64_t stream) noexcept nogil:
    cdef PyThreadState *state
    cdef int rc
    if h == NULL or h.context == NULL:
        return _invalid(b"stream_wait: the handle is NULL or released")
    state = _let_go()
    rc = handle_stream_wait(<daemon_core *>h.context, h.slot, h.gen, stream)
    _take_back(state)
    return rc


cdef int _release(dfccl_handle *h) noexcept nogil:
    cdef PyThreadState *state
    cdef int rc
    if h == NULL:
        return _invalid(b"release: the handle is NULL")
    if h.context == NULL:
        return DFCCL_API_OK
    state = _let_go()
    rc = handle_release(<daemon_core *>h.context, h.slot, h.gen)
    _take_back(state)
    if rc == DFCCL_API_OK:
        h.context = NULL
        h.slot = 0
        h.gen = 0
    return rc


cdef const char *_error_string(int code) noexcept nogil:
    if code == DFCCL_API_OK:
        return b"completed (or submitted)"
    if code == DFCCL_API_PENDING:
        return b"pending: not complete yet"
    if code == DFCCL_API_FAILED:
        return b"the collective failed (see its status)"
    if code == DFCCL_API_E_INVALID:
        return b"invalid argument"
    if code == DFCCL_API_E_RESOURCE:
        return b"out of completion slots, tag records or staging"
    if code == DFCCL_API_E_CLOSED:
        return b"the communicator or its daemon is closed"
    if code == DFCCL_API_E_BACKEND:
        return b"the device or the backend failed"
    if code == DFCCL_API_E_PYTHON:
        return b"an error raised in Python"
    return b"unknown code"


cdef const char *_last_error() noexcept nogil:
    return last_error_message()


cdef int _plan_retain(const dfccl_plan *plan) noexcept with gil:
    if plan == NULL:
        return record_error(InvalidArgumentError("plan_retain: the plan is NULL"))
    Py_INCREF(<object>(<plan_t *>plan).descriptor)
    return DFCCL_API_OK


cdef int _plan_release(const dfccl_plan *plan) noexcept with gil:
    if plan == NULL:
        return record_error(InvalidArgumentError("plan_release: the plan is NULL"))
    Py_DECREF(<object>(<plan_t *>plan).descriptor)
    return DFCCL_API_OK


cdef dfccl_api _table
_table.size = sizeof(dfccl_api)
_table.version = DFCCL_API_VERSION
_table.submit = _submit
_table.test = _test
_table.wait = _wait
_table.stream_wait = _stream_wait
_table.release = _release
_table.error_string = _error_string
_table.last_error = _last_error
_table.plan_retain = _plan_retain
_table.plan_release = _plan_release

API_VERSION = DFCCL_API_VERSION
CAPSULE_NAME = (<bytes>DFCCL_API_CAPSULE).decode()


def api_capsule():
    """The C API's table (dfccl_api.h) in a PyCapsule named CAPSULE_NAME."""
    return PyCapsule_New(&_table, DFCCL_API_CAPSULE, NULL)


# What PyCapsule_Import(DFCCL_API_CAPSULE) finds.
api = api_capsule()

__all__ = ["API_VERSION", "CAPSULE_NAME", "api", "api_capsule"]
