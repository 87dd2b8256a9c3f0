"""The KV write on CUDA as FlashInfer's ``append_paged_kv_cache``, its arrays made once a step.

The torch write (`kv_write.write_kv`) turns each token's flat slot into a cache row with five
small kernels and then scatters K and V (eight kernels per layer on CUDA, the slot arithmetic
redone in every layer). FlashInfer's ``append_paged_kv_cache`` does the write in one kernel
per layer from the step's page table and, per new token, its row (``batch_indices``) and its
position among that row's keys (``positions``): the token lands in page
``kv_indices[kv_indptr[b] + pos // page_size]`` at entry ``pos % page_size``, and it reads K
and V through their strides (the QKV output's views, no copy).

`append_rows` computes those per-token arrays on the host from the step's FlashInfer arrays
(int32, already on the host: no sync), `pack_append_layout` lays everything out in one int32
array, and `stage_append_layout` copies it to the device once per step (page-locked, not
awaited): into a fresh tensor for an eager step, into the (slot, KV group)'s static buffer
for a CUDA-graph bucket, at offsets fixed by the bucket's size, so the captured graph's
addresses stay valid. A padded graph row (one page, the sink, one key) writes the sink page's
entry 0, the slot `attention.pad_decode_layout` gives it.

`append_kv_reference` is FlashInfer's contract in torch: the CPU tests check the arrays
against the slot-based write and run the engine's wiring with it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = [
    "AppendLayout",
    "KVAppend",
    "append_kv_reference",
    "append_rows",
    "flashinfer_kv_append",
    "pack_append_layout",
    "stage_append_layout",
    "static_append_size",
]


class AppendLayout(NamedTuple):
    """``append_paged_kv_cache``'s per-step arrays (int32, on the cache's device)."""

    batch_indices: torch.Tensor  # [T]: each new token's row
    positions: torch.Tensor  # [T]: its position among the row's keys
    kv_indices: torch.Tensor  # the step's pages (a static buffer may hold more after them)
    kv_indptr: torch.Tensor  # [rows + 1]
    kv_last_page_len: torch.Tensor  # [rows]


def append_rows(
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, position) of every new token, int32 on the host: row b's ``q_len`` new tokens are
    the last of its ``(pages - 1) * page_size + last_page_len`` keys."""
    i64 = torch.int64
    qo = qo_indptr.to("cpu", i64)
    q_lens = qo[1:] - qo[:-1]
    pages = kv_indptr[1:].to("cpu", i64) - kv_indptr[:-1].to("cpu", i64)
    seq_lens = (pages - 1).clamp_(min=0) * page_size + kv_last_page_len.to("cpu", i64)
    total = int(qo[-1]) if qo.numel() else 0
    rows = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens, output_size=total)
    first = (seq_lens - q_lens - qo[:-1])[rows]  # position of the row's token 0, minus its index
    positions = torch.arange(total, dtype=i64) + first
    return rows.to(torch.int32), positions.to(torch.int32)


def pack_append_layout(
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
    *,
    pin: bool = False,
) -> torch.Tensor:
    """One int32 host array: rows [T] | positions [T] | kv_indptr [n+1] | last [n] | pages."""
    rows, positions = append_rows(qo_indptr, kv_indptr, kv_last_page_len, page_size)
    parts = (rows, positions, kv_indptr, kv_last_page_len, kv_indices)
    sizes = [p.numel() for p in parts]
    packed = torch.empty(sum(sizes), dtype=torch.int32, pin_memory=pin)
    torch.cat([p.to("cpu", torch.int32).reshape(-1) for p in parts], out=packed)
    return packed


def static_append_size(batch_size: int, max_pages: int) -> int:
    """int32 entries of a graph bucket's static append buffer."""
    return 4 * batch_size + 1 + max_pages


def _views(device_packed: torch.Tensor, tokens: int, rows: int) -> AppendLayout:
    t, n = tokens, rows
    return AppendLayout(
        batch_indices=device_packed[:t],
        positions=device_packed[t : 2 * t],
        kv_indptr=device_packed[2 * t : 2 * t + n + 1],
        kv_last_page_len=device_packed[2 * t + n + 1 : 2 * t + 2 * n + 1],
        kv_indices=device_packed[2 * t + 2 * n + 1 :],
    )


def stage_append_layout(
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
    device: torch.device,
    static: torch.Tensor | None = None,
) -> AppendLayout:
    """The step's `AppendLayout` on ``device``: one copy, queued and not awaited; into
    ``static`` (a graph bucket's buffer, `static_append_size` entries) when given."""
    rows = max(qo_indptr.numel() - 1, 0)
    tokens = int(qo_indptr[-1]) if rows else 0
    cuda = device.type == "cuda"
    packed = pack_append_layout(
        qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size, pin=cuda
    )
    if static is None:
        dev = packed.to(device, non_blocking=True) if cuda else packed
        return _views(dev, tokens, rows)
    if packed.numel() > static.numel():
        raise ValueError(
            f"the step's append layout ({packed.numel()} entries) exceeds its static buffer "
            f"({static.numel()})"
        )
    static[: packed.numel()].copy_(packed, non_blocking=cuda)
    return _views(static, tokens, rows)


def append_kv_reference(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
) -> None:
    """FlashInfer's ``append_paged_kv_cache`` contract in torch, one 5-D NHD cache
    ``[pages, 2, page_size, H, D]``."""
    assert kv_layout == "NHD"
    page_size = paged_kv_cache.shape[2]
    pos = positions.long()
    page_iter = kv_indptr.long()[batch_indices.long()] + pos // page_size
    pages = kv_indices.long()[page_iter]
    entry = pos % page_size
    paged_kv_cache[pages, 0, entry] = append_key.to(paged_kv_cache.dtype)
    paged_kv_cache[pages, 1, entry] = append_value.to(paged_kv_cache.dtype)


class KVAppend:
    """One layer's KV write through an ``append_paged_kv_cache`` with FlashInfer's signature
    (FlashInfer's on CUDA, `append_kv_reference` in the CPU tests); ``calls`` counts them."""

    def __init__(self, append: Callable[..., Any]) -> None:
        self._append = append
        self.calls = 0

    def __call__(
        self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AppendLayout
    ) -> None:
        self.calls += 1
        self._append(
            k, v, layout.batch_indices, layout.positions, kv_layer,
            layout.kv_indices, layout.kv_indptr, layout.kv_last_page_len, "NHD",
        )  # fmt: skip


def flashinfer_kv_append() -> KVAppend | None:
    """FlashInfer's KV write; None when ``MSTAR_FLASHINFER_KV_APPEND=0`` (the torch write by
    slots, the fallback if a device ever disagrees) or FlashInfer is not importable."""
    if os.environ.get("MSTAR_FLASHINFER_KV_APPEND", "1") == "0":
        return None
    try:
        page = importlib.import_module("flashinfer.page")
    except ImportError:
        return None
    return KVAppend(page.append_paged_kv_cache)
