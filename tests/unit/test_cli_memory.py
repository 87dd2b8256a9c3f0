"""`mstar-engine serve` returns the heap that loading freed (`cli.release_freed_heap`).

glibc keeps freed chunks below the heap's top resident; the server asks for them to be given
back once the model is loaded, so its RSS is what serving holds, not what loading peaked at.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
from pathlib import Path

import pytest

from mstar.engine.cli import release_freed_heap

MIB = 2**20


def _rss() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) * 1024  # type: ignore[union-attr]


def test_freed_heap_below_a_live_chunk_is_returned() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "malloc_trim"):
        pytest.skip("not glibc: no malloc_trim to call")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(4096) for _ in range(16384)]  # 64 MiB, below the mmap threshold
    for c in chunks:
        ctypes.memset(c, 1, 4096)
    pin = libc.malloc(4096)  # a live chunk above them: the heap's top cannot shrink past it
    try:
        for c in chunks:
            libc.free(c)
        before = _rss()
        assert release_freed_heap()
        assert before - _rss() > 32 * MIB
    finally:
        libc.free(pin)
