"""Attention resource: turns KV's paged addressing into one backend plan per step.

The backend (`mstar.kernels`: batched torch on CPU, FlashInfer on CUDA) is planned once per
step; every layer then only scatters its new K/V into the paged cache and runs the planned
kernel. The plan result is the `AttentionContext` the decoder calls per layer. The model's
softmax scale and each layer's sliding window (Mistral, Gemma 3) are the resource's, given at
construction: the backends take them at plan time (FlashInfer plans one wrapper per window)
and each layer's window again when it runs.

On a hybrid model (`KVGroups`: Gemma 3's sliding and full layers in KV groups of their own)
each group has its own page table, so its own backend, planned from its `KVPlan.groups` entry;
a layer runs on its group's backend and write slots.

Under a slot lease with a CUDA-graph bucket the step is planned into that (bucket, slot)'s own
backend and the slot's static write-slot buffer instead, padded to the bucket with rows on the
KV sink page (`pad_decode_layout`): the addresses the captured graph recorded stay the same, and
the other slot's buffers (the step in flight) are never written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from mstar.engine.resources.base import Resource
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.config import pages_for
from mstar.engine.resources.kv.plan import KVPlan
from mstar.engine.resources.static_buffers import GrowOnlyBuffers
from mstar.engine.resources.step import ResourceStep, SlotLease, StepContext
from mstar.kernels import FlashInferPagedAttention, TorchPagedAttention, write_kv
from mstar.kernels.flashinfer_kv_write import (
    AppendLayout,
    KVAppend,
    flashinfer_kv_append,
    stage_append_layout,
    static_append_size,
)
from mstar.kernels.paged_attention import KernelDecodeStep
from mstar.kernels.paged_layout import KernelDecodeLayers


class PaddedLayout(NamedTuple):
    """A decode step's CSR arrays padded to ``bs`` rows, pad rows on the sink page."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    write_slots: torch.Tensor  # int64 [bs], on the KV plan's device


def pad_decode_layout(plan: KVPlan, bs: int, sink_page: int) -> PaddedLayout:
    """Append ``bs - n`` one-token rows that read and write only page ``sink_page``, slot 0."""
    n = len(plan.request_ids)
    if n > bs:
        raise ValueError(f"{n} rows do not fit a bucket of {bs}")
    if n and not plan.is_decode:
        raise ValueError("only decode steps (one token per row) replay a graph")
    pad = bs - n
    i32 = torch.int32
    qo = torch.arange(bs + 1, dtype=i32)
    kv_tail = plan.kv_indptr[-1:].to(i32) if n else torch.zeros(1, dtype=i32)
    kv_indptr = torch.cat([plan.kv_indptr[:-1].to(i32), kv_tail + torch.arange(pad + 1, dtype=i32)])
    kv_indices = torch.cat([plan.kv_indices.to(i32), torch.full((pad,), sink_page, dtype=i32)])
    last = torch.cat([plan.kv_last_page_len.to(i32), torch.ones(pad, dtype=i32)])
    # write_slots stay on the cache's device: no device-to-host copy on the replay path.
    dev = plan.write_slots.device
    sink_slot = torch.full((pad,), sink_page * plan.page_size, dtype=torch.int64, device=dev)
    write_slots = torch.cat([plan.write_slots.to(torch.int64), sink_slot])
    return PaddedLayout(qo, kv_indptr, kv_indices, last, write_slots)


def graph_backend(backend: Any, batch_size: int, max_pages: int) -> Any:
    """A backend for one (bucket, slot): FlashInfer's CUDA-graph decode wrapper over fixed
    buffers, or (CPU, torch) a backend of its own that the padded eager path plans into."""
    if isinstance(backend, FlashInferPagedAttention):
        return backend.graph_decode(batch_size, max_pages)
    return TorchPagedAttention(backend.device)


class PagedAttentionContext:
    """One step's attention: per layer, write K/V at the planned slots, then attend.

    A decode-only step on the CPU kernels is resolved once here (`KernelDecodeStep`), so each
    layer makes two kernel calls and a few stride checks. ``backends`` / ``write_slots`` /
    ``decodes`` hold one entry per KV group; ``layer_group`` maps a layer to its group.
    """

    __slots__ = (
        "appends",
        "backends",
        "cache",
        "decodes",
        "kv_append",
        "layer_group",
        "windows",
        "write_slots",
    )

    def __init__(
        self,
        cache: KVCache,
        backends: Sequence[Any],
        write_slots: Sequence[torch.Tensor],
        windows: tuple[int, ...] = (),
        layer_group: tuple[int, ...] = (),
        kv_append: KVAppend | None = None,
        appends: Sequence[AppendLayout] = (),
    ) -> None:
        """``kv_append`` / ``appends``: each layer's KV write as ``append_paged_kv_cache``
        over its group's layout, planned once for the step (else the write by slots)."""
        self.cache = cache
        self.backends = tuple(backends)
        self.write_slots = tuple(write_slots)
        #: per layer, the keys a query sees (0: all); empty: every layer full
        self.windows = windows
        #: per layer, its KV group; empty: one group
        self.layer_group = layer_group
        self.kv_append = kv_append if appends else None
        self.appends = tuple(appends)
        dtype = cache.tensor.dtype
        self.decodes: tuple[KernelDecodeStep | None, ...] = tuple(
            b.decode_step(s, dtype)
            if isinstance(b, TorchPagedAttention) and self.kv_append is None
            else None
            for b, s in zip(self.backends, self.write_slots, strict=True)
        )

    def kernel_decode(self) -> KernelDecodeLayers | None:
        """This step for `cpu_kernels.decode_layers` (see `Decoder`), where it is decode-only
        on the kernels in every KV group and the cache is contiguous; None otherwise."""
        cache = self.cache.tensor
        if any(d is None for d in self.decodes) or not cache.is_contiguous():
            return None
        layers = len(self.cache.layer_slot)
        return KernelDecodeLayers(
            steps=self.decodes,  # type: ignore[arg-type]  # no None: checked above
            cache=cache,
            windows=self.windows or (0,) * layers,
            layer_group=self.layer_group or (0,) * layers,
            layer_slot=tuple(self.cache.layer_slot),
        )

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kv_layer = self.cache.layer_view(layer_idx)
        if q.dtype != kv_layer.dtype:
            # `--kv-cache-dtype` bfloat16 under float32 activations (llama.cpp's f16 cache):
            # k, v stored rounded, q rounded to take its dot products in the cache's dtype,
            # the output widened back (the fused C++ loop casts the same, so the same bits).
            cache_dtype, out_dtype = kv_layer.dtype, q.dtype
            q, k, v = q.to(cache_dtype), k.to(cache_dtype), v.to(cache_dtype)
            return self.attend(layer_idx, q, k, v, sinks).to(out_dtype)
        window = self.windows[layer_idx] if self.windows else 0
        g = self.layer_group[layer_idx] if self.layer_group else 0
        decode = self.decodes[g]
        if decode is not None and decode.fits(q, k, v, kv_layer):
            return decode(q, k, v, kv_layer, window, sinks)
        if self.kv_append is not None:
            self.kv_append(kv_layer, k, v, self.appends[g])
        else:
            write_kv(kv_layer, k, v, self.write_slots[g])
        backend = self.backends[g]
        if sinks is None:  # backends without sinks take the arguments they always did
            out: torch.Tensor = backend.run(q, kv_layer, window)
        else:
            out = backend.run(q, kv_layer, window, sinks)
        return out


class AttentionResource(Resource):
    """Plans the attention backend from `ctx.plan_results["kv"]` (its only dependency)."""

    def __init__(
        self,
        cache: KVCache,
        backend: Any,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kv_key: str = "kv",
        sink_page: int | None = None,
        sm_scale: float | None = None,
        layer_windows: Sequence[int] = (),
        group_backends: Sequence[Any] = (),
        kv_append: KVAppend | None = None,
    ) -> None:
        """``sm_scale``: the softmax scale (default ``head_dim ** -0.5``); ``layer_windows``:
        per layer, the keys a query sees (0: all; empty: every layer full);
        ``group_backends``: a backend per KV group after main (the cache's `KVGroups`);
        ``kv_append``: the KV write as ``append_paged_kv_cache`` (default: FlashInfer's with
        the FlashInfer backend, else the write by slots)."""
        if kv_append is None and isinstance(backend, FlashInferPagedAttention):
            kv_append = flashinfer_kv_append()
        #: the step's KV write, one kernel per layer over arrays staged once (`plan`)
        self.kv_append = kv_append
        self.cache = cache
        self.sm_scale = sm_scale
        self.windows = tuple(layer_windows) if any(layer_windows) else ()
        self.backend = backend
        self.backends = (backend, *group_backends)
        groups = cache.groups
        if len(self.backends) != len(groups.labels):
            raise ValueError(
                f"{len(self.backends)} attention backends for {len(groups.labels)} KV groups"
            )
        self.layer_group = groups.layer_group if groups.hybrid else ()
        #: per group, the windows its layers run with (FlashInfer plans a wrapper per window)
        self._group_windows = tuple(
            frozenset(w for w, g in zip(self.windows, groups.layer_group, strict=False) if g == i)
            for i in range(len(groups.labels))
        )
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_key = kv_key
        self.sink_page = sink_page
        self._graph_backends: dict[SlotLease, tuple[Any, ...]] = {}
        self._slot_buffers: dict[int, GrowOnlyBuffers] = {}

    def depends_on(self) -> set[str]:
        return {self.kv_key}

    def build_cuda_graph_buffers(
        self, slots: Sequence[SlotLease], max_bs: int, max_seq_len: int
    ) -> None:
        """Backends per (bucket, slot) and KV group, write-slot buffers per slot and group;
        existing ones stay."""
        if self.sink_page is None:
            raise RuntimeError("CUDA-graph padding needs the KV cache's sink page")
        pages_per_row = pages_for(max_seq_len, self.cache.page_size)
        for spec in slots:
            bufs = self._slot_buffers.setdefault(spec.slot, GrowOnlyBuffers(self.cache.device))
            for g in range(len(self.backends)):
                bufs.ensure(_slots_name(g), max_bs, torch.int64)
                if self.kv_append is not None:
                    size = static_append_size(max_bs, max_bs * pages_per_row)
                    bufs.ensure(_append_name(g), size, torch.int32)
            if spec not in self._graph_backends and spec.bucket is not None:
                bs = spec.bucket.bs
                self._graph_backends[spec] = tuple(
                    graph_backend(b, bs, bs * pages_per_row) for b in self.backends
                )

    def plan(self, step: ResourceStep, ctx: StepContext) -> PagedAttentionContext:
        kv: KVPlan = ctx.plan_results[self.kv_key]
        lease = ctx.slot_lease
        if lease is not None and lease.bucket is not None:
            return self._plan_graph(kv, lease)
        plans = (kv, *kv.groups)
        for g, (backend, p) in enumerate(zip(self.backends, plans, strict=True)):
            self._plan(backend, g, p.qo_indptr, p.kv_indptr, p.kv_indices, p.kv_last_page_len)
        slots = [p.write_slots for p in plans]
        appends = []
        if self.kv_append is not None:
            ps, dev = self.cache.page_size, self.cache.device
            appends = [
                stage_append_layout(
                    p.qo_indptr, p.kv_indptr, p.kv_indices, p.kv_last_page_len, ps, dev
                )
                for p in plans
            ]
        return PagedAttentionContext(
            self.cache, self.backends, slots, self.windows, self.layer_group,
            self.kv_append, appends,
        )  # fmt: skip

    def _plan_graph(self, kv: KVPlan, lease: SlotLease) -> PagedAttentionContext:
        assert lease.bucket is not None and self.sink_page is not None
        backends = self._graph_backends.get(lease)
        if backends is None:
            raise RuntimeError(f"no CUDA-graph buffers were built for {lease}")
        bs = lease.bucket.bs
        bufs = self._slot_buffers[lease.slot]
        write_slots, appends = [], []
        for g, (backend, p) in enumerate(zip(backends, (kv, *kv.groups), strict=True)):
            lay = pad_decode_layout(p, bs, self.sink_page)
            self._plan(
                backend, g, lay.qo_indptr, lay.kv_indptr, lay.kv_indices, lay.kv_last_page_len
            )
            slots = bufs.get(_slots_name(g), bs)
            slots.copy_(lay.write_slots, non_blocking=True)
            write_slots.append(slots)
            if self.kv_append is not None:
                # this bucket's views of the slot's buffer: fixed offsets, fixed addresses
                static = bufs.get(_append_name(g), bufs.size(_append_name(g)))
                appends.append(
                    stage_append_layout(
                        lay.qo_indptr, lay.kv_indptr, lay.kv_indices, lay.kv_last_page_len,
                        self.cache.page_size, self.cache.device, static,
                    )
                )  # fmt: skip
        return PagedAttentionContext(
            self.cache, backends, write_slots, self.windows, self.layer_group,
            self.kv_append, appends,
        )  # fmt: skip

    def _plan(
        self,
        backend: Any,
        group: int,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
    ) -> None:
        backend.plan(
            qo_indptr,
            kv_indptr,
            kv_indices,
            kv_last_page_len,
            num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            page_size=self.cache.page_size,
            causal=True,
            sm_scale=self.sm_scale,
            windows=self._group_windows[group],
        )


def _slots_name(group: int) -> str:
    return f"write_slots{group}" if group else "write_slots"


def _append_name(group: int) -> str:
    return f"kv_append{group}"
