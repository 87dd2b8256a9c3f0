"""Where the C++ kernels keep packed weights (``huge_pages.cpp``): memory the kernel is asked to
back with 2 MiB pages, packed in place from a stack of experts, and alive for as long as any
tensor in its chunk is, at every ISA level this CPU runs and every small-batch layout it has.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from kernel_levels import level_kernels

from mstar.kernels import cpu_isa

HUGE_PAGE = 2 << 20


def _packs() -> list[tuple[str, str, torch.dtype]]:
    """(level, pack function, dtype) for every level this CPU runs and every layout it has."""
    cases = []
    for level in cpu_isa.supported_levels():
        cases += [(level.name, "fma_pack_weight", torch.float32)]
        cases += [(level.name, "fma_pack_weight", torch.bfloat16)]
        if "avx512_bf16" in level.requires:
            cases.append((level.name, "dpbf16_pack_weight", torch.bfloat16))
        if "amx_tile" in level.requires:
            cases.append((level.name, "amx_pack_weight", torch.bfloat16))
    return cases


def _pack(level: str, name: str) -> Any:
    return getattr(level_kernels(level), name)


def _thp_mode() -> str:
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    found = re.search(r"\[(\w+)\]", text)
    assert found is not None, text
    return found.group(1)


def _mapping_flags(address: int) -> str:
    """The VmFlags line of this process's mapping that holds ``address``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head and int(head.group(1), 16) <= address < int(head.group(2), 16):
            for flags in lines[i + 1 :]:
                if flags.startswith("VmFlags:"):
                    return flags
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize(("level", "name", "dtype"), _packs())
def test_a_large_packed_weight_is_advised_into_huge_pages(level, name, dtype) -> None:
    small = _pack(level, name)(torch.randn(96, 64).to(dtype))
    packed = _pack(level, name)(torch.randn(4096, 2048).to(dtype))  # 16 MiB: a chunk of its own
    assert packed.data_ptr() % HUGE_PAGE == 0
    if _thp_mode() == "never":
        pytest.skip("transparent huge pages are off on this host: the advice is ignored")
    for weight in (packed, small):  # a shared chunk is advised too
        assert " hg" in _mapping_flags(weight.data_ptr())  # MADV_HUGEPAGE took


@pytest.mark.parametrize(("level", "name", "dtype"), _packs())
def test_a_stack_of_experts_packs_as_each_expert_alone(level, name, dtype) -> None:
    pack = _pack(level, name)
    stack = torch.randn(5, 40, 72).to(dtype)  # neither a whole panel nor a whole K step
    packed = pack(stack)
    assert packed.shape[0] == 5
    for e in range(5):
        assert torch.equal(packed[e], pack(stack[e]))


@pytest.mark.parametrize(("level", "name", "dtype"), _packs())
def test_small_weights_share_a_chunk_and_outlive_their_neighbours(level, name, dtype) -> None:
    pack = _pack(level, name)
    weights = [torch.randn(48, 64).to(dtype) for _ in range(6)]
    packed = [pack(w) for w in weights]
    starts = sorted(p.data_ptr() for p in packed)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # carved one after another from a chunk (a new chunk at most once), not a mapping each
    assert sum(gap > 1 << 20 for gap in gaps) <= 1, gaps
    kept = packed[3]
    del packed
    # Two ~10 MiB weights move the shared chunk on, so only kept still holds its old one; the
    # memory freed next is handed out again and zeroed by the following packs.
    rows = (10 << 20) // (1024 * torch.tensor([], dtype=dtype).element_size())
    filler = [pack(torch.randn(rows, 1024).to(dtype)) for _ in range(2)]
    del filler
    for _ in range(3):
        pack(torch.randn(rows, 1024).to(dtype))
    assert torch.equal(kept, pack(weights[3]))
