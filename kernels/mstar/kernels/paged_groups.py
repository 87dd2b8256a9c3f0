"""The padded groups `TorchPagedAttention` attends: a step's sequences as dense tensors.

A group pads its sequences to the longest query run and page list, so attention is one batched
call per group; decode rows (one query) and extend rows (several) are grouped apart, so one long
prefill does not pad every decode row. Masks are built per window at first use: the C++ kernels
never read them, only the torch path does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PaddedGroup:
    """Sequences attended together: padded to ``q_max`` queries and ``pages_max`` pages."""

    page_table: torch.Tensor  # int64 [B * pages_max] page ids (padding -> a valid page)
    kv_lens: torch.Tensor  # int64 [B] keys of each sequence
    #: per window (0: none), bool [B, 1, q_max, pages_max * page_size], built at first use
    #: (`group_mask`): the kernels never read it
    masks: dict[int, torch.Tensor]
    q_rows: torch.Tensor  # int64 [B * q_max] row of q feeding each padded query slot
    out_src: torch.Tensor  # int64 [n] padded slot of each real query token
    out_dst: torch.Tensor  # int64 [n] its row in the flat output
    q_starts: torch.Tensor  # int64 [B] first query row of each sequence (`paged_prefill`)
    q_lens: torch.Tensor  # int64 [B] its query count
    batch: int
    q_max: int
    pages_max: int
    #: per sequence (first query row, queries, keys), for the extend path's per-row attention
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    #: per window, the additive float32 form of its mask for the one-query matmuls
    biases: dict[int, torch.Tensor] = field(default_factory=dict)
    #: rows of a layer viewed as ``[-1, head_dim]`` for K then V, head-major (see `_kv_rows`)
    kv_rows: torch.Tensor | None = None


def decode_group(
    kvp: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor, dev: torch.device
) -> PaddedGroup:
    """Every sequence one query, row b sequence b: `build_group`'s tensors in a third of
    its ops (a decode step's attention plan was ~5% of a batch-1 step)."""
    n_pages = kvp[1:] - kvp[:-1]
    j = torch.arange(int(n_pages.max()))
    page_pos = kvp[:-1, None] + torch.minimum(j[None, :], (n_pages - 1)[:, None])
    return padded_decode(kv_indices[page_pos], kv_lens, dev)


def padded_decode(
    page_table: torch.Tensor, kv_lens: torch.Tensor, dev: torch.device
) -> PaddedGroup:
    """`decode_group` from its page table (int64 [B, pages_max], padded with each row's last
    page) and kv_lens (int64 [B])."""
    batch, pages_max = page_table.shape
    rows = torch.arange(batch, device=dev)
    return PaddedGroup(
        page_table=page_table.reshape(-1).to(dev),
        kv_lens=kv_lens.to(dev),
        masks={},
        q_rows=rows,
        out_src=rows,
        out_dst=rows,
        batch=batch,
        q_max=1,
        pages_max=pages_max,
        q_starts=rows,
        q_lens=torch.ones(batch, dtype=torch.int64, device=dev),
    )


def group_mask(g: PaddedGroup, page_size: int, causal: bool, window: int = 0) -> torch.Tensor:
    """``g.masks[window]``: key k visible to query r iff k < kv_len and (causally)
    k <= kv_len - q_len + r, and (``window``) k > that last key - window; padded query
    rows see key 0 only, so their softmax stays finite (they are dropped)."""
    if window in g.masks:
        return g.masks[window]
    dev = g.kv_lens.device
    keys = torch.arange(g.pages_max * page_size, device=dev)
    rows = torch.arange(g.q_max, device=dev)
    if causal:
        limit = (g.kv_lens - g.q_lens)[:, None] + rows[None, :]  # [B, q_max] last visible
    else:
        limit = (g.kv_lens - 1)[:, None].expand(g.batch, g.q_max)
    real = rows[None, :] < g.q_lens[:, None]  # [B, q_max]
    mask = (keys[None, None, :] <= limit[:, :, None]) & real[:, :, None]
    if window:
        mask &= keys[None, None, :] > limit[:, :, None] - window
    mask[:, :, 0] |= ~real
    g.masks[window] = mask.unsqueeze(1)
    return g.masks[window]


def build_group(
    seqs: torch.Tensor,
    qo: torch.Tensor,
    kvp: torch.Tensor,
    kv_indices: torch.Tensor,
    q_lens_all: torch.Tensor,
    kv_lens_all: torch.Tensor,
    dev: torch.device,
) -> PaddedGroup:
    """The sequences ``seqs`` of a step's CSR plan, padded to their longest query run and
    page list (decode and extend rows are built as separate groups)."""
    batch = int(seqs.numel())
    q_lens = q_lens_all[seqs]
    kv_lens = kv_lens_all[seqs]
    n_pages = kvp[seqs + 1] - kvp[seqs]
    q_max = int(q_lens.max())
    pages_max = int(n_pages.max())
    # Page table: page j of sequence b, padded with the sequence's first page (masked out).
    j = torch.arange(pages_max)
    page_pos = kvp[seqs][:, None] + torch.minimum(j[None, :], (n_pages - 1)[:, None])
    page_table = kv_indices[page_pos]
    rows = torch.arange(q_max)
    real = rows[None, :] < q_lens[:, None]  # [B, q_max]
    q_rows = qo[seqs][:, None] + torch.minimum(rows[None, :], (q_lens - 1)[:, None])
    slot = torch.arange(batch * q_max).view(batch, q_max)
    return PaddedGroup(
        page_table=page_table.reshape(-1).to(dev),
        kv_lens=kv_lens.to(dev),
        masks={},
        q_rows=q_rows.reshape(-1).to(dev),
        out_src=slot[real].to(dev),
        out_dst=q_rows[real].to(dev),
        batch=batch,
        q_max=q_max,
        pages_max=pages_max,
        q_starts=qo[seqs].to(dev),
        q_lens=q_lens.to(dev),
        spans=list(zip(qo[seqs].tolist(), q_lens.tolist(), kv_lens.tolist(), strict=True)),
    )
