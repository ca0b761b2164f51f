"""glibc's allocator controls, where the process runs on glibc (None/no-ops elsewhere).

Shared by the server's memory policy (server/memory.py: thresholds, trims after refused input)
and by the parts that free a large model (audio/transcription.py), whose pages glibc would
otherwise keep."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time


def _load() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.gnu_get_libc_version  # noqa: B018 (musl has no such symbol, nor these semantics)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


#: The C library, when it is glibc.
GLIBC = _load()


def trim_now() -> float:
    """Give every free page back (``malloc_trim(0)``); returns the seconds it took."""
    if GLIBC is None:
        return 0.0
    began = time.perf_counter()
    GLIBC.malloc_trim(0)
    return time.perf_counter() - began
