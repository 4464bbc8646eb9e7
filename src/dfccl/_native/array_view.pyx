# cython: language_level=3
"""The memory of a host array through the buffer protocol: what the plain
call needs (address, element count, element format) without the dictionary
that ``__array_interface__`` builds on every access (~2 us in numpy, most of
a plain call's host time)."""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE, PyBUF_FORMAT, PyBUF_C_CONTIGUOUS

__all__ = ["host_array_view"]


def host_array_view(obj):
    """(address, element count, format character, item size) of a writable,
    C-contiguous buffer whose format is one native character ("f", "q", ...);
    None for anything else (a read-only or strided array, a format with a
    byte-order prefix or several fields, an object without the protocol),
    which the caller's general path then describes or rejects."""
    cdef Py_buffer view
    cdef const char *fmt
    try:
        PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
    except (BufferError, TypeError, ValueError):
        return None
    try:
        fmt = view.format
        if fmt == NULL or fmt[0] == 0 or fmt[1] != 0 or view.itemsize <= 0:
            return None
        return (<size_t>view.buf, view.len // view.itemsize, chr(fmt[0]), view.itemsize)
    finally:
        PyBuffer_Release(&view)
