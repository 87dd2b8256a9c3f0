"""What `mstar-engine serve` hands back to the OS once the model is loaded.

Two kinds of resident memory a serving process holds but never uses again:

- heap that loading freed (the GGUF read, the tokenizer build, the conversion's float tensors):
  glibc keeps freed chunks resident until asked (`release_freed_heap`);
- on CPU, the pages of the CUDA libraries that ``import torch`` maps (PyPI's torch is the CUDA
  build, also in the CPU image): loading them touches ~140 MiB of their read-only code and data
  that a CPU engine never runs (`drop_unused_cuda_pages`).

Neither changes what serving computes; a page dropped is read back from its file if touched.

It also says how much of the process sits in transparent huge pages (`huge_page_share`): the
kernels advise their packed weights into 2 MiB pages, worth ~1.3x of batch-1 decode on a VM,
and a host with THP off or no free 2 MiB block quietly gives 4 KiB pages instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Iterator
from dataclasses import dataclass

#: madvise(2) advice: drop the range's pages; a private file mapping refaults them from the file
MADV_DONTNEED = 4
#: the CUDA libraries PyPI's torch loads: the nvidia-* wheels' folder and torch's own CUDA parts
CUDA_PATH_PARTS = ("/site-packages/nvidia/",)
CUDA_LIB_PREFIXES = ("libtorch_cuda", "libc10_cuda", "libtorch_nvshmem")


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/self/smaps with the fields `drop_unused_cuda_pages` reads (KiB)."""

    start: int
    end: int
    perms: str
    path: str
    rss_kib: int = 0
    dirty_kib: int = 0
    anon_kib: int = 0


def mappings(smaps: str = "/proc/self/smaps") -> Iterator[Mapping]:
    """The process's mappings, in address order."""
    head: list[str] | None = None
    sizes: dict[str, int] = {}

    def done() -> Mapping:
        assert head is not None
        start, end = (int(x, 16) for x in head[0].split("-"))
        dirty = sizes.get("Private_Dirty", 0) + sizes.get("Shared_Dirty", 0)
        path = head[5] if len(head) > 5 else ""
        return Mapping(
            start, end, head[1], path, sizes.get("Rss", 0), dirty, sizes.get("Anonymous", 0)
        )

    with open(smaps) as f:
        for line in f:
            parts = line.split()
            if parts and not parts[0].endswith(":"):  # "start-end perms offset dev inode [path]"
                if head is not None:
                    yield done()
                head, sizes = parts, {}
            elif len(parts) >= 2 and parts[1].isdigit():
                sizes[parts[0][:-1]] = int(parts[1])
    if head is not None:
        yield done()


def is_cuda_library(path: str) -> bool:
    return any(p in path for p in CUDA_PATH_PARTS) or os.path.basename(path).startswith(
        CUDA_LIB_PREFIXES
    )


def drop_unused_cuda_pages() -> int:
    """Drop the resident pages of the CUDA libraries' read-only, never-written file mappings
    (code and constants): a CPU engine does not run them. Writable or dirtied mappings (their
    relocated data) are left alone, so nothing but a re-read is lost. Returns the KiB dropped
    (0 where /proc or madvise is missing)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    madvise = getattr(libc, "madvise", None)
    if madvise is None or not os.path.exists("/proc/self/smaps"):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for m in list(mappings()):
        clean = m.rss_kib and not m.dirty_kib and not m.anon_kib
        read_only = "w" not in m.perms and m.perms.endswith("p")
        if clean and read_only and is_cuda_library(m.path):
            dropped += m.rss_kib if madvise(m.start, m.end - m.start, MADV_DONTNEED) == 0 else 0
    return dropped


def release_freed_heap() -> bool:
    """Return the C heap's free pages to the OS (glibc's ``malloc_trim``; False where the C
    library has none)."""
    trim = getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


def huge_page_share(rollup: str = "/proc/self/smaps_rollup") -> tuple[int, int] | None:
    """(anonymous memory in transparent huge pages, resident memory), in KiB, of the process
    whose ``smaps_rollup`` this is; None where the file or its fields are missing."""
    try:
        with open(rollup) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["AnonHugePages"].split()[0]), int(fields["Rss"].split()[0])
    except (OSError, KeyError, ValueError, IndexError):
        return None
