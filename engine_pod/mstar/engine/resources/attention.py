"""Attention resource: turns KV's paged addressing into one backend plan per step.

The backend (`mstar.kernels`: batched torch on CPU, FlashInfer on CUDA) is planned once per
step; every layer then only scatters its new K/V into the paged cache and runs the planned
kernel. The plan result is the `AttentionContext` the decoder calls per layer.
"""

from __future__ import annotations

from typing import Any

import torch

from mstar.engine.resources.base import Resource
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.plan import KVPlan
from mstar.engine.resources.step import ResourceStep, StepContext
from mstar.kernels import write_kv


class PagedAttentionContext:
    """One step's attention: per layer, write K/V at the planned slots, then attend."""

    __slots__ = ("backend", "cache", "write_slots")

    def __init__(self, cache: KVCache, backend: Any, write_slots: torch.Tensor) -> None:
        self.cache = cache
        self.backend = backend
        self.write_slots = write_slots

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        kv_layer = self.cache.layer_view(layer_idx)
        write_kv(kv_layer, k, v, self.write_slots)
        out: torch.Tensor = self.backend.run(q, kv_layer)
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
    ) -> None:
        self.cache = cache
        self.backend = backend
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_key = kv_key

    def depends_on(self) -> set[str]:
        return {self.kv_key}

    def plan(self, step: ResourceStep, ctx: StepContext) -> PagedAttentionContext:
        kv: KVPlan = ctx.plan_results[self.kv_key]
        self.backend.plan(
            kv.qo_indptr,
            kv.kv_indptr,
            kv.kv_indices,
            kv.kv_last_page_len,
            num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            page_size=kv.page_size,
            causal=True,
        )
        return PagedAttentionContext(self.cache, self.backend, kv.write_slots)
