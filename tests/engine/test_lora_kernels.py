"""The batched LoRA kernel (``lora_add_``) at every ISA level this CPU runs, float32 and bf16,
against a per-row float64 reference, and the gathered torch path (CUDA's) against the same:
rows of several slots, the base (-1) and slots whose rank leaves rows of A/B unused, in
segments of mixed lengths, into a column slice of a wider output."""

from __future__ import annotations

import pytest
import torch
from kernel_levels import level_kernels

from mstar.kernels import cpu_isa
from mstar.kernels.lora import lora_add_, lora_add_torch, token_slots

SLOTS, MAX_RANK, K, N, WIDTH, OFFSET = 4, 16, 72, 40, 100, 30  # K, N: no whole vector count
RANKS = [16, 0, 5, 8]  # slot 1 adds nothing to this projection
LENGTHS = [3, 1, 7, 1, 1, 9, 2]
SEG_SLOTS = [0, -1, 2, 3, 0, 3, -1]


def _case(
    dtype: torch.dtype,
    ranks: list[int] = RANKS,
    lengths: list[int] = LENGTHS,
    seg_slots: list[int] = SEG_SLOTS,
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    rows = sum(lengths)
    x = torch.randn(rows, K, generator=gen).to(dtype)
    y = torch.randn(rows, WIDTH, generator=gen).to(dtype)
    max_rank = max(MAX_RANK, *ranks)
    a = torch.zeros(len(ranks), max_rank, K)
    b = torch.zeros(len(ranks), max_rank, N)
    for s, r in enumerate(ranks):  # rows past a slot's rank are zero, as the pool writes them
        a[s, :r] = torch.randn(r, K, generator=gen) * 0.3
        b[s, :r] = torch.randn(r, N, generator=gen) * 0.3
    scales = torch.tensor([0.5, 2.0, 1.5, 0.25][: len(ranks)])
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long)
    rank_t = torch.tensor(ranks, dtype=torch.long)
    return x, y, a.to(dtype), b.to(dtype), rank_t, scales, indptr, torch.tensor(seg_slots)


def _reference(*case: torch.Tensor) -> torch.Tensor:
    x, y, a, b, scales, indptr, seg_slot = case
    out = y.double().clone()
    for g, s in enumerate(seg_slot.tolist()):
        if s < 0:
            continue
        rows = slice(int(indptr[g]), int(indptr[g + 1]))
        update = (x[rows].double() @ a[s].double().T) @ b[s].double() * float(scales[s])
        out[rows, OFFSET : OFFSET + N] += update
    return out


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-5 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", [lv.name for lv in cpu_isa.supported_levels()])
def test_kernel_matches_reference(level: str, dtype: torch.dtype) -> None:
    x, y, a, b, ranks, scales, indptr, seg_slot = _case(dtype)
    want = _reference(x, y, a, b, scales, indptr, seg_slot)
    before = y.clone()
    lora_add_(y, x, a, b, ranks, scales, indptr, seg_slot, OFFSET, kernels=level_kernels(level))
    _close(y, want, dtype)
    base_rows = torch.repeat_interleave(seg_slot, torch.tensor(LENGTHS)) < 0
    assert torch.equal(y[base_rows], before[base_rows])  # the base rows are untouched
    outside = torch.ones(WIDTH, dtype=torch.bool)
    outside[OFFSET : OFFSET + N] = False
    assert torch.equal(y[:, outside], before[:, outside])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", [lv.name for lv in cpu_isa.supported_levels()])
def test_kernel_blocks_of_many_rows_and_high_ranks(level: str, dtype: torch.dtype) -> None:
    """A slot's rows from non-adjacent segments, more of them than one register block holds
    at any level, odd ranks (bf16 pairs ranks two at a time) and ranks past the kernel's
    on-stack shrink buffer (64)."""
    lengths, seg_slots = [37, 5, 20, 1], [0, 1, 0, 2]
    case = _case(dtype, [80, 67, 3], lengths, seg_slots)
    x, y, a, b, ranks, scales, indptr, seg_slot = case
    want = _reference(x, y, a, b, scales, indptr, seg_slot)
    lora_add_(y, x, a, b, ranks, scales, indptr, seg_slot, OFFSET, kernels=level_kernels(level))
    _close(y, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_torch_path_matches_reference(dtype: torch.dtype) -> None:
    x, y, a, b, _, scales, indptr, seg_slot = _case(dtype)
    want = _reference(x, y, a, b, scales, indptr, seg_slot)
    lora_add_torch(y, x, a, b, scales, token_slots(indptr, seg_slot, x.device), OFFSET)
    _close(y, want, dtype)


def test_kernel_refuses_bad_segments() -> None:
    x, y, a, b, ranks, scales, indptr, _ = _case(torch.float32)
    ext = level_kernels(cpu_isa.supported_levels()[-1].name)
    bad = torch.tensor([0, -1, 9, 3, 0, 3, -1])
    with pytest.raises(RuntimeError, match="outside"):
        ext.lora_add_(y, x, a, b, ranks, scales, indptr, bad, OFFSET)
    with pytest.raises(RuntimeError, match="outside y"):
        ext.lora_add_(y, x, a, b, ranks, scales, indptr, torch.tensor(SEG_SLOTS), WIDTH - 10)


@pytest.mark.parametrize("level", [lv.name for lv in cpu_isa.supported_levels()])
def test_decode_hook_refuses_weights_that_do_not_add_up(level: str) -> None:
    """``LoraDecode`` (what `decode_layers` adds after each projection) takes one entry per
    part and 4 part counts per layer, and says which list is wrong."""
    kernels = level_kernels(level)
    _, _, a, b, ranks, scales, _, _ = _case(torch.float32)
    parts = [a] * 4
    per_part = (parts, [b] * 4, [ranks] * 4, [scales] * 4, [OFFSET] * 4)
    kernels.LoraDecode(*per_part, [1, 1, 1, 1])  # one layer, one part per projection
    with pytest.raises(RuntimeError, match="4 counts per layer"):
        kernels.LoraDecode(*per_part, [1, 1, 2])
    with pytest.raises(RuntimeError, match="parts add up to 5, not 4"):
        kernels.LoraDecode(*per_part, [2, 1, 1, 1])
    with pytest.raises(RuntimeError, match="one entry per part"):
        kernels.LoraDecode(parts, [b] * 3, [ranks] * 4, [scales] * 4, [OFFSET] * 4, [1, 1, 1, 1])
