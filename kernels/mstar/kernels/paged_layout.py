"""Paged layouts shared by the attention backends: key counts from the CSR plan, the plan's
validation, one-query rows per query (deterministic mode, sliding-window prompt rows), the head-
major row ids of a gathered layer, and a decode-only step resolved once for the C++ kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from mstar.kernels import cpu_kernels


def kv_lengths(
    kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Tokens in each sequence's cache: full pages plus the last page's fill."""
    pages = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    return (pages - 1) * page_size + kv_last_page_len.to(torch.int64)


def per_query_rows(
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same attention as one one-query sequence per query row (int64 CSR arrays).

    Row r of a sequence with q queries and L keys sees its first L - q + r + 1 keys (all L when
    not causal): its own pages are the sequence's first pages up to that key.
    """
    qo, kvp = qo_indptr.to(torch.int64), kv_indptr.to(torch.int64)
    q_lens = qo[1:] - qo[:-1]
    seq = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
    kv_lens = kv_lengths(kvp, kv_last_page_len, page_size)[seq]
    if causal:
        kv_lens = kv_lens - q_lens[seq] + (torch.arange(seq.numel()) - qo[seq]) + 1
    pages = (kv_lens + page_size - 1) // page_size
    row_indptr = torch.zeros(seq.numel() + 1, dtype=torch.int64)
    torch.cumsum(pages, 0, out=row_indptr[1:])
    first = torch.repeat_interleave(kvp[seq] - row_indptr[:-1], pages)
    indices = kv_indices.to(torch.int64)[first + torch.arange(int(row_indptr[-1]))]
    last = kv_lens - (pages - 1) * page_size
    return torch.arange(seq.numel() + 1), row_indptr, indices, last


def validate_plan(
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reject malformed plans with a message instead of silently reading wrong pages; returns
    each sequence's queries and keys (int64, on the plan's device) for the planner to reuse.
    One check covers every rule (a plan is checked every step); the messages come after."""
    n = kv_last_page_len.shape[0]
    if qo_indptr.shape[0] != n + 1 or kv_indptr.shape[0] != n + 1:
        raise ValueError("qo_indptr and kv_indptr must have len(kv_last_page_len) + 1 entries")
    if int(kv_indptr[-1]) > kv_indices.shape[0]:
        raise ValueError("kv_indptr points past the end of kv_indices")
    q_lens = (qo_indptr[1:] - qo_indptr[:-1]).to(torch.int64)
    n_pages = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    last = kv_last_page_len.to(torch.int64)
    kv_lens = kv_lengths(kv_indptr, kv_last_page_len, page_size)
    ok = (q_lens >= 0) & (n_pages >= 1) & (last >= 1) & (last <= page_size) & (q_lens <= kv_lens)
    if bool(ok.all()):
        return q_lens, kv_lens
    if bool((q_lens < 0).any()) or bool((n_pages < 1).any()):
        raise ValueError("every sequence needs >= 0 queries and >= 1 KV page")
    if bool(((last < 1) | (last > page_size)).any()):
        raise ValueError(f"kv_last_page_len must be in [1, {page_size}]")
    raise ValueError("a sequence has more queries than KV tokens (write K/V before attending)")


def decode_rows(
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A valid decode-only plan on the CPU (sequence b is query row b) as (kv_lens int64 [B],
    page table int64 [B, pages_max], each row padded with its last page), or None: the general
    path plans it (`validate_plan` names what is wrong). `validate_plan` + `decode_group` in
    numpy, ~10 small ops against ~50 torch ones: a hybrid model plans every KV group each step
    (Gemma 3 270M: 6 groups, ~0.6 ms of an 18 ms batch-1 step before)."""
    arrays = (qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
    if any(t.device.type != "cpu" for t in arrays):
        return None
    qo, kvp, idx, last = (t.numpy() for t in arrays)
    n = last.shape[0]
    if not 0 < n == qo.shape[0] - 1 == kvp.shape[0] - 1 or qo[0] != 0 or kvp[-1] > idx.shape[0]:
        return None
    n_pages = kvp[1:].astype(np.int64) - kvp[:-1]
    if ((qo[1:] - qo[:-1] != 1) | (n_pages < 1) | (last < 1) | (last > page_size)).any():
        return None
    kv_lens = (n_pages - 1) * page_size + last
    pos = kvp[:-1, None] + np.minimum(np.arange(n_pages.max()), n_pages[:, None] - 1)
    return torch.from_numpy(kv_lens), torch.from_numpy(idx[pos].astype(np.int64))


@dataclass(slots=True)
class KernelDecodeStep:
    """A decode-only step on the C++ kernels, resolved once per step: each layer is then one
    `cpu_kernels.write_kv` and one `cpu_kernels.paged_decode` call. The generic path (`write_kv`,
    `TorchPagedAttention.run`) re-derives the same choice in ~15 Python checks per layer."""

    kernel: Any
    page_table: torch.Tensor
    kv_lens: torch.Tensor
    scale: float
    slots: torch.Tensor
    #: per layer, the keys a query sees (0: all); empty: every layer full
    windows: tuple[int, ...] = ()

    def fits(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor
    ) -> bool:
        """The layouts the kernels read in place: one dtype, rows of whole heads."""
        heads = cpu_kernels.heads_contiguous
        return (
            q.dtype == kv_layer.dtype == k.dtype == v.dtype
            and kv_layer.is_contiguous()
            and heads(q)
            and heads(k)
            and heads(v)
        )

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write k/v at the step's slots, then attend q; row b of q is sequence b
        (``sinks``: float32 [Hq] attention-sink logits, or None)."""
        self.kernel.write_kv(kv_layer, k, v, self.slots)
        out: torch.Tensor = self.kernel.paged_decode(
            q, kv_layer, self.page_table, self.kv_lens, self.scale, window, sinks
        )
        return out


class KernelDecodeLayers(NamedTuple):
    """A decode-only step for `cpu_kernels.decode_layers`: each KV group's `KernelDecodeStep`
    (one on a model without sliding-window groups), the whole cache [slots, pages, 2, S, Hkv,
    D], and per layer its window (0: all keys), KV group and slot in the cache's first dim."""

    steps: tuple[KernelDecodeStep, ...]
    cache: torch.Tensor
    windows: tuple[int, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]


def kv_row_ids(page_table: torch.Tensor, page_size: int, heads: int) -> torch.Tensor:
    """Row ids into a ``[pages, 2, S, H, D]`` layer viewed as ``[-1, D]``, ordered [2, B, H, L].

    Key ``l`` of sequence ``b`` lives in page ``page_table[b, l // S]`` at offset ``l % S``.
    """
    batch, pages = page_table.shape
    dev = page_table.device
    page = page_table.view(1, batch, 1, pages, 1)
    plane = torch.arange(2, device=dev).view(2, 1, 1, 1, 1)
    head = torch.arange(heads, device=dev).view(1, 1, heads, 1, 1)
    offset = torch.arange(page_size, device=dev).view(1, 1, 1, 1, page_size)
    return (((page * 2 + plane) * page_size + offset) * heads + head).reshape(-1)
