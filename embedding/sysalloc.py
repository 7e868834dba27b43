"""Keep freed memory in the process (glibc) instead of returning it to the OS every step.

Each training step allocates and frees the same large blocks (conv activations, the B x N NCA
buffer: tens of MB each). glibc serves such blocks with mmap and gives them back with munmap, so
every step page-faults them in again: measured on the 2-core CPU machine, 11.9 s of system time
in a 33 s epoch; with the settings below 0.6 s, and the epoch 20 % faster (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to 1 GiB; returns False where glibc is absent."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): nothing to tune
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30)
    ok &= mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    ok &= mallopt(_M_TOP_PAD, 256 << 20)
    return bool(ok)


def default_freed_memory() -> bool:
    """Undo keep_freed_memory: glibc's own thresholds again (128 KiB, as its defaults start). For
    a process whose large blocks come from an inference engine that sizes them per input shape
    (OpenVINO, ONNX Runtime): kept, they fragmented the heap (a Lite0 model process 6.1 GB
    after warming 64 batch sizes on OpenVINO, 1.7 GB with these; docs/PERFORMANCE.md)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, 128 << 10)
    ok &= mallopt(_M_TRIM_THRESHOLD, 128 << 10)
    ok &= mallopt(_M_TOP_PAD, 0)
    return bool(ok)


_libc = None


def release_free_memory() -> bool:
    """Give the heap's free memory back to the OS now (glibc malloc_trim): after a request that
    decoded large images, whose freed blocks keep_freed_memory() would otherwise keep."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
            if _libc:
                _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return False
    return bool(_libc.malloc_trim(0))
