"""Paged attention backends: a common plan-once/run-per-layer interface, and the torch one.

Every step the engine describes the batch once (``plan``) in FlashInfer's CSR form: sequence i
owns query rows ``qo_indptr[i]:qo_indptr[i+1]`` (its newest tokens) and KV pages
``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``, the last one holding ``kv_last_page_len[i]`` tokens.
Then every layer calls ``run(q, kv_layer)``. Planning once matters: index and mask building is
per-step work that must not be repeated 30 times.

``TorchPagedAttention`` is the CPU path. It never loops over requests per layer: ``plan`` builds,
for at most two groups of sequences (decode rows with one query, and extend rows with several),
a padded page table and a boolean mask; ``run`` gathers the group's K and V rows straight into
the head-major layout the matmuls read, in one ``index_select``, and attends once per group.
On CPU both groups skip the gather: `cpu_kernels.paged_decode` (one query) and
`cpu_kernels.paged_prefill` (causal prompt chunks) read the pages in place.

Sliding-window layers (``run(..., window=W)``: a query sees its last W keys, its own
included, as transformers' masks do) take `paged_decode`'s window for decode rows; prompt rows
of such a layer become one-query rows over their own keys (`per_query_rows`), so the window is
one per-row bound in the same kernel, and the torch path masks it.

Attention sinks (gpt-oss, ``run(..., sinks=s)``): a learned logit per query head joins each
softmax's denominator (and its max) but weighs no value, so a head may attend to nothing. The
kernels take them as float32 [Hq]; the torch path appends them as one more score column.

``deterministic`` (``--deterministic``): the two kernels sum a position's scores and values in
different orders, so a token's numbers would depend on whether it was attended in a prompt
chunk, a whole prompt or a decode step (recompute, prefix hits, step budgets). Every query row
then becomes a one-query "sequence" over its own visible keys (`per_query_rows`) and the whole
step is one `paged_decode` call: one order per position, whatever the step's composition.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from mstar.kernels import cpu_kernels
from mstar.kernels.attention_sinks import attend_with_sinks, softmax_with_sinks
from mstar.kernels.paged_groups import (
    PaddedGroup,
    build_group,
    decode_group,
    group_mask,
    padded_decode,
)
from mstar.kernels.paged_layout import (
    KernelDecodeStep,
    decode_rows,
    kv_lengths,
    kv_row_ids,
    per_query_rows,
    validate_plan,
)

__all__ = [
    "KernelDecodeStep",
    "PagedAttentionBackend",
    "TorchPagedAttention",
    "kv_lengths",
    "per_query_rows",
    "validate_plan",
]


class PagedAttentionBackend(Protocol):
    """What the engine calls: ``plan`` once per step, ``run`` once per layer."""

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        causal: bool = True,
        sm_scale: float | None = None,
        windows: frozenset[int] = frozenset(),
    ) -> None:
        """``windows``: the sliding windows the step's layers will ``run`` with (a backend
        that plans per window needs them here; 0 is a full layer)."""
        ...

    def run(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``sinks``: float32 [Hq] attention-sink logits (gpt-oss), or None."""
        ...


class TorchPagedAttention:
    """Batched paged attention in plain torch (CPU, or any device as a reference)."""

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        use_kernels: bool = True,
        deterministic: bool = False,
    ) -> None:
        """``use_kernels``: attend with `cpu_kernels` on CPU where they build;
        ``deterministic``: every query row through `paged_decode` (see the module docstring),
        which needs the kernels (ValueError without them)."""
        self.device = torch.device(device)
        use = use_kernels and self.device.type == "cpu"
        self._kernel = cpu_kernels.load() if use else None
        if deterministic and self._kernel is None:
            raise ValueError("deterministic attention needs the C++ CPU kernels (CPU only)")
        self.deterministic = deterministic
        self._groups: list[PaddedGroup] = []
        self._num_tokens = 0
        self._num_qo_heads = 0
        self._num_kv_heads = 0
        self._head_dim = 0
        self._page_size = 0
        self._scale = 1.0
        self._causal = True
        #: the step's CSR arrays (int64, CPU), for `_rows_group`
        self._csr: tuple[torch.Tensor, ...] = ()
        #: every query row as a one-query sequence (sliding-window prompt rows), built at
        #: first use in a step
        self._rows: PaddedGroup | None = None

    @property
    def uses_kernels(self) -> bool:
        """True when attention goes to the C++ kernels (CPU, built, not switched off)."""
        return self._kernel is not None

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        causal: bool = True,
        sm_scale: float | None = None,
        windows: frozenset[int] = frozenset(),
    ) -> None:
        """Build gather indices and masks for this step (int32 CPU inputs); ``sm_scale``:
        the softmax scale (default ``head_dim ** -0.5``); ``windows`` need no plan here (a
        window's mask or row group is built at its first ``run``)."""
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} not a multiple of {num_kv_heads}")
        decode = None if self.deterministic else decode_rows(
            qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size
        )  # fmt: skip
        if decode is None:
            q_lens, kv_lens = validate_plan(
                qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size
            )
        if self.deterministic:
            if not cpu_kernels.supports_head_dim(head_dim):
                raise ValueError(f"deterministic attention: no kernel for head_dim {head_dim}")
            qo_indptr, kv_indptr, kv_indices, kv_last_page_len = per_query_rows(
                qo_indptr.cpu(),
                kv_indptr.cpu(),
                kv_indices.cpu(),
                kv_last_page_len.cpu(),
                page_size,
                causal,
            )
            q_lens, kv_lens = validate_plan(
                qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size
            )
        self._num_qo_heads = num_qo_heads
        self._num_kv_heads = num_kv_heads
        self._head_dim = head_dim
        self._page_size = page_size
        self._scale = head_dim**-0.5 if sm_scale is None else sm_scale
        self._causal = causal
        self._csr = (qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
        self._rows = None
        if decode is not None:
            lens, table = decode
            self._num_tokens = lens.shape[0]
            self._groups = [padded_decode(table, lens, self.device)]
            return
        qo = qo_indptr.to(torch.int64).cpu()
        kvp = kv_indptr.to(torch.int64).cpu()
        self._num_tokens = int(qo[-1]) if qo.numel() else 0
        q_lens, kv_lens = q_lens.cpu(), kv_lens.cpu()
        if 0 < q_lens.shape[0] == self._num_tokens and bool((q_lens == 1).all()):
            self._groups = [
                decode_group(kvp, kv_indices.to(torch.int64).cpu(), kv_lens, self.device)
            ]
            return
        seqs = torch.arange(q_lens.shape[0])
        self._groups = []
        # Decode rows (one query) and extend rows (several) are padded separately, so one long
        # prefill does not pad every decode row to its length.
        for selected in (seqs[q_lens == 1], seqs[q_lens > 1]):
            if selected.numel():
                self._groups.append(
                    build_group(
                        selected,
                        qo,
                        kvp,
                        kv_indices.to(torch.int64).cpu(),
                        q_lens,
                        kv_lens,
                        self.device,
                    )
                )

    def _mask(self, g: PaddedGroup, window: int) -> torch.Tensor:
        return group_mask(g, self._page_size, self._causal, window)

    def _rows_group(self) -> PaddedGroup:
        """This step's query rows, each a one-query sequence over the keys it sees."""
        if self._rows is None:
            qo, kvp, idx, last = (t.to(torch.int64).cpu() for t in self._csr)
            _, rows_kvp, rows_idx, rows_last = per_query_rows(
                qo, kvp, idx, last, self._page_size, self._causal
            )
            lens = kv_lengths(rows_kvp, rows_last, self._page_size)
            self._rows = decode_group(rows_kvp, rows_idx, lens, self.device)
        return self._rows

    def run(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for q [T, Hq, D] against one layer's cache; returns [T, Hq, D].
        ``window`` > 0: each query sees its last ``window`` keys only; ``sinks``: float32
        [Hq] logits in every softmax's denominator (gpt-oss)."""
        if q.shape[0] != self._num_tokens:
            raise ValueError(f"planned for {self._num_tokens} query rows, got {q.shape[0]}")
        hq, d = self._num_qo_heads, self._head_dim
        kernel = self._kernel_for(q, kv_layer)
        if kernel is None and self.deterministic:
            raise ValueError(
                f"deterministic attention: the kernels take float32 or bf16 (q {q.dtype}, cache "
                f"{kv_layer.dtype}) in a contiguous cache"
            )
        if kernel is not None and not cpu_kernels.heads_contiguous(q):
            q = q.contiguous()
        if kernel is not None and len(self._groups) == 1 and self._groups[0].q_max == 1:
            # Decode rows only: row i is sequence i, so the kernel reads q in place (a view of
            # the fused QKV rows) and its output is the answer, no gather or scatter.
            return self._kernel_decode(kernel, self._groups[0], q, kv_layer, window, sinks)
        if kernel is not None and window:
            return self._kernel_decode(kernel, self._rows_group(), q, kv_layer, window, sinks)
        out = q.new_empty(q.shape)
        for g in self._groups:
            if g.q_max == 1 and kernel is not None:
                qg = q.index_select(0, g.q_rows)  # [B, Hq, D], contiguous
                decoded = self._kernel_decode(kernel, g, qg, kv_layer, 0, sinks)
                out.index_copy_(0, g.out_dst, decoded)
                continue
            if kernel is not None and self._causal:
                # Prompt chunks: causal attention over the cache pages, rows written in place.
                page_table = g.page_table.view(g.batch, -1)
                kernel.paged_prefill(
                    q,
                    kv_layer,
                    page_table,
                    g.kv_lens,
                    g.q_starts,
                    g.q_lens,
                    self._scale,
                    out,
                    sinks,
                )
                continue
            length = g.pages_max * self._page_size
            k, v = self._gather(g, kv_layer)  # [B, Hkv, L, D] each
            if g.q_max == 1:
                qg = q.index_select(0, g.q_rows).view(g.batch, g.q_max, hq, d)
                flat = self._decode_rows(g, qg, k.reshape(-1, length, d), v, window, sinks)
                out.index_copy_(0, g.out_dst, flat.index_select(0, g.out_src))
                continue
            self._extend_rows(g, q, k, v, out, window, sinks)
        return out

    def _extend_rows(
        self,
        g: PaddedGroup,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Several queries per sequence: SDPA one sequence at a time, over its real keys only.

        A fresh prompt (queries == keys) takes SDPA's ``is_causal`` path with no mask; a chunk
        after cached keys takes its slice of the planned mask. Measured on CPU (32 prompts of
        20-200 tokens, SmolLM2's heads): 8.7 ms per layer against 22 ms for one masked SDPA
        over the batch padded to its longest prompt.
        """
        gqa = self._num_qo_heads != self._num_kv_heads
        for b, (start, n, kv_len) in enumerate(g.spans):
            # 4-D [1, H, n, D]: with 3-D inputs (or GQA on 3-D) CPU SDPA falls back to its
            # math path, measured 4-16x slower here than the flash kernel it picks for 4-D.
            qb = q[start : start + n].transpose(0, 1)[None]
            kb, vb = k[b : b + 1, :, :kv_len], v[b : b + 1, :, :kv_len]
            if sinks is not None:  # SDPA has no sink: the scores, one more column, softmax
                mask = self._mask(g, window)[b : b + 1, :, :n, :kv_len]
                o = attend_with_sinks(qb, kb, vb, mask, self._scale, sinks)
            elif n == kv_len and self._causal and not window:
                o = F.scaled_dot_product_attention(
                    qb, kb, vb, is_causal=True, scale=self._scale, enable_gqa=gqa
                )
            else:
                mask = self._mask(g, window)[b : b + 1, :, :n, :kv_len]
                o = F.scaled_dot_product_attention(
                    qb, kb, vb, attn_mask=mask, scale=self._scale, enable_gqa=gqa
                )
            out[start : start + n] = o[0].transpose(0, 1)

    def decode_step(self, write_slots: torch.Tensor, dtype: torch.dtype) -> KernelDecodeStep | None:
        """The planned step as a `KernelDecodeStep` when it is decode rows only and the kernels
        take ``dtype`` and this head dim on the CPU; None otherwise (the generic path)."""
        kernel = self._kernel
        if (
            kernel is None
            or len(self._groups) != 1
            or self._groups[0].q_max != 1
            or dtype not in cpu_kernels.DTYPES
            or not cpu_kernels.supports_head_dim(self._head_dim)
        ):
            return None
        g = self._groups[0]
        slots = write_slots.to(device=self.device, dtype=torch.int64).contiguous()
        page_table = g.page_table.view(g.batch, -1)
        return KernelDecodeStep(kernel, page_table, g.kv_lens, self._scale, slots)

    def _kernel_decode(
        self,
        kernel: Any,
        g: PaddedGroup,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`cpu_kernels.paged_decode` over a one-query group; q [B, Hq, D], row b = sequence b."""
        page_table = g.page_table.view(g.batch, -1)
        out: torch.Tensor = kernel.paged_decode(
            q, kv_layer, page_table, g.kv_lens, self._scale, window, sinks
        )
        return out

    def _kernel_for(self, q: torch.Tensor, kv_layer: torch.Tensor) -> Any | None:
        """The C++ attention kernels if they handle this layer, else None (torch path)."""
        fits = (
            q.dtype in cpu_kernels.DTYPES
            and kv_layer.dtype == q.dtype
            and kv_layer.is_contiguous()
            and cpu_kernels.supports_head_dim(self._head_dim)
        )
        return self._kernel if fits else None

    def _gather(self, g: PaddedGroup, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's K and V pages, head-major ``[B, Hkv, L, D]``, in one copy of each row.

        Head-major is the layout both matmuls (and SDPA) want, so gathering straight into it
        replaces a page gather plus a transposing copy of K and of V in every layer.
        """
        hkv, d = self._num_kv_heads, self._head_dim
        length = g.pages_max * self._page_size
        if not kv_layer.is_contiguous():  # a strided view: gather pages, then transpose
            pages = kv_layer.index_select(0, g.page_table)  # [B*P, 2, S, Hkv, D]
            kv = pages.view(g.batch, length // self._page_size, 2, -1, hkv, d)
            kv = kv.permute(2, 0, 4, 1, 3, 5).reshape(2, g.batch, hkv, length, d)
            return kv[0], kv[1]
        if g.kv_rows is None:
            g.kv_rows = kv_row_ids(g.page_table.view(g.batch, -1), self._page_size, hkv)
        kv = kv_layer.view(-1, d).index_select(0, g.kv_rows).view(2, g.batch, hkv, length, d)
        return kv[0], kv[1]

    def _decode_rows(
        self,
        g: PaddedGroup,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query per sequence: two batched matmuls, scores and probabilities in float32.

        ``k`` is ``[B*Hkv, L, D]``, ``v`` ``[B, Hkv, L, D]``, both contiguous. bf16/fp16 inputs
        are widened first and only the output is rounded: rounding the scores and probabilities
        to bf16 too (as this path once did) gave errors up to 2.8x the output's own rounding
        (0.022 vs 0.0078 at scores of +-20) and flipped greedy tokens against FlashInfer and
        the CPU kernels, which keep both in float32.
        On CPU, SDPA's one-query path is far slower than this for decode (float32 ~20x: 71 ms
        vs 3 ms for the score product at batch 18 x 512 keys). ``baddbmm`` applies the scale and
        the mask inside the score matmul.
        """
        hq, hkv, d = self._num_qo_heads, self._num_kv_heads, self._head_dim
        group = hq // hkv
        if window not in g.biases:
            mask = self._mask(g, window)
            zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
            bias = zeros.masked_fill_(~mask, float("-inf")).view(g.batch, 1, 1, -1)
            g.biases[window] = bias.expand(g.batch, hkv, group, -1).reshape(
                g.batch * hkv, group, -1
            )
        qg = q.view(g.batch * hkv, group, d).float()  # one query row: heads grouped by KV head
        bias = g.biases[window]
        scores = torch.baddbmm(bias, qg, k.transpose(1, 2).float(), alpha=self._scale)
        if sinks is not None:  # [Hq] as [Hkv, group] per sequence: rows b * Hkv + kv head
            sink = sinks.view(1, hkv, group, 1).expand(g.batch, -1, -1, -1)
            probs = softmax_with_sinks(scores, sink.reshape(g.batch * hkv, group, 1))
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs, v.reshape(g.batch * hkv, -1, d).float())
        return out.to(q.dtype).view(g.batch, hq, d)
