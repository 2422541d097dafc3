"""Read-only file mappings that hold no file descriptor (:func:`map_readonly`).

Python's ``mmap.mmap`` keeps a duplicate of its descriptor while the mapping lives (``trackfd=False`` only
from Python 3.13), so a reader would hold one per mapped file until ``EMFILE``; the kernel needs none, so
this module calls libc's ``mmap`` directly and the caller closes its descriptor at once. The mapping goes
when the last numpy array over it is garbage-collected. Where libc cannot be loaded (not Linux/glibc-like)
it falls back to ``mmap.mmap`` and its descriptor. Design: docs/storage.md#reading-segments."""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

import numpy as np

# MADV_POPULATE_READ (Linux >= 5.14; Python's mmap module names it from 3.13 only)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if hasattr(mmap, "MADV_WILLNEED") else None)


def _load_libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int64]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap.restype = ctypes.c_int
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    if ctypes.sizeof(ctypes.c_void_p) != 8:  # off_t is 64-bit only on 64-bit builds
        return None
    return libc


_LIBC = _load_libc()
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_readonly(fd: int, size: int, dtype: np.dtype, prefault_bytes: int) -> np.ndarray:
    """The first ``size`` bytes of the open file ``fd`` as a read-only array of ``dtype``;
    the caller may close ``fd`` at once. ``prefault_bytes`` of it are faulted in with one
    ``MADV_POPULATE_READ`` (where the kernel has it). Raises ValueError when the file is
    now shorter than ``size`` (as ``mmap.mmap`` does), OSError for other failures."""
    if _LIBC is None:
        return _map_with_python_mmap(fd, size, dtype, prefault_bytes)
    if os.fstat(fd).st_size < size:
        raise ValueError("mmap length is greater than file size")
    address = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of {size} bytes failed: {os.strerror(errno)}")
    memory = (ctypes.c_ubyte * size).from_address(address)
    weakref.finalize(memory, _LIBC.munmap, address, size)
    if MADV_POPULATE_READ is not None and prefault_bytes > 0:
        _LIBC.madvise(address, min(prefault_bytes, size), MADV_POPULATE_READ)  # EINVAL before 5.14: ignored
    # a read-only view: the pages are PROT_READ, so a write would be a segfault, not an error
    return np.frombuffer(memoryview(memory).toreadonly(), dtype=dtype)


def _map_with_python_mmap(fd: int, size: int, dtype: np.dtype, prefault_bytes: int) -> np.ndarray:
    mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    if MADV_POPULATE_READ is not None and prefault_bytes > 0:
        try:
            mapping.madvise(MADV_POPULATE_READ, 0, min(prefault_bytes, size))
        except OSError:
            pass
    return np.frombuffer(mapping, dtype=dtype)
