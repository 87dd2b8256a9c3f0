"""What `mstar-engine serve` hands back once loaded (`mstar.engine.startup_memory`).

glibc keeps freed chunks below the heap's top resident until asked (`release_freed_heap`); a CPU
engine never runs the CUDA libraries PyPI's torch maps (`drop_unused_cuda_pages`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
from pathlib import Path

import pytest
import torch

from mstar.engine.startup_memory import (
    Mapping,
    drop_unused_cuda_pages,
    huge_page_share,
    is_cuda_library,
    mappings,
    release_freed_heap,
)

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


def test_huge_page_share_reads_the_rollup(tmp_path) -> None:
    rollup = tmp_path / "smaps_rollup"
    rollup.write_text(
        "55d0-7ffd ---p 00000000 00:00 0  [rollup]\nRss:             3135688 kB\n"
        "Anonymous:       2900000 kB\nAnonHugePages:   1366016 kB\n"
    )
    assert huge_page_share(str(rollup)) == (1366016, 3135688)
    rollup.write_text("Rss:             3135688 kB\n")  # a kernel without THP accounting
    assert huge_page_share(str(rollup)) is None
    assert huge_page_share(str(tmp_path / "missing")) is None
    huge, rss = huge_page_share() or (-1, -1)  # this process
    assert 0 <= huge <= rss
    assert abs(rss * 1024 - _rss()) < 64 * MIB


def _cuda_read_only() -> list[Mapping]:
    return [
        m
        for m in mappings()
        if is_cuda_library(m.path) and "r" in m.perms and "w" not in m.perms and not m.dirty_kib
    ]


def test_cpu_engine_drops_the_cuda_libraries_clean_pages() -> None:
    # PyPI's torch (CI's and the CPU image's) is the CUDA build: importing it maps those libraries.
    libs = _cuda_read_only()
    assert libs, "no CUDA library mapped: is this torch the CPU-only build?"
    # one of a few MiB, faulted in whole: resident whatever earlier tests did
    lib = min((m for m in libs if m.end - m.start >= 2**20), key=lambda m: m.end - m.start)
    ctypes.string_at(lib.start, lib.end - lib.start)
    resident = {m.start: m.rss_kib for m in _cuda_read_only()}
    assert resident[lib.start] * 1024 >= (lib.end - lib.start) // 2
    assert drop_unused_cuda_pages() >= sum(resident.values()) // 2
    after = {m.start: m.rss_kib for m in _cuda_read_only()}
    assert after[lib.start] < resident[lib.start] // 10
    a = torch.arange(12.0).reshape(3, 4)  # torch still runs (its CPU code was not touched)
    assert torch.equal(a @ a.T, torch.tensor([[14.0, 38, 62], [38, 126, 214], [62, 214, 366]]))
