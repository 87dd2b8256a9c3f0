"""The KV pool and the attention one rank builds: rank 0's engine and every other rank of a
tensor-parallel replica size and shape them the same way (`parallel.worker`), each over its
own KV heads."""

from __future__ import annotations

from typing import Any

import torch

from mstar.engine.config import EngineConfig
from mstar.engine.model.config import ModelConfig
from mstar.engine.model.tp import page_kv_heads
from mstar.engine.resources.attention import AttentionResource
from mstar.engine.resources.kv import KVConfig, KVGroups
from mstar.engine.resources.kv.allocator import SINK_PAGE
from mstar.engine.resources.kv.cache import KVCache
from mstar.kernels import select_attention_backend

GIB = 1 << 30
CPU_DEFAULT_KV_BYTES = 1 * GIB


def kv_pages(
    config: EngineConfig, cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> tuple[int, int]:
    """(pages, bytes per page) of this rank's KV pool: ``--num-pages``, or free device memory
    on CUDA / a fixed host budget on CPU over one page of a rank's KV heads (`page_kv_heads`:
    the same count on every rank of a tensor-parallel replica)."""
    heads = page_kv_heads(cfg, config.tensor_parallel_size)
    # A page holds every layer, or on a hybrid model one KV group's share (`KVGroups`).
    slots = KVGroups.for_layers(cfg.num_layers, cfg.layer_windows).slots
    elements = cfg.kv_elements_per_token // cfg.num_kv_heads * heads * slots // cfg.num_layers
    bytes_per_page = elements * config.page_size * torch.empty((), dtype=dtype).element_size()
    if config.num_pages:
        return config.num_pages, bytes_per_page
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization)
    else:
        budget = CPU_DEFAULT_KV_BYTES
    return max(2, budget // bytes_per_page), bytes_per_page


def rank_kv_config(
    cfg: ModelConfig,
    config: EngineConfig,
    num_pages: int,
    dtype: torch.dtype,
    device: torch.device,
    **policy: Any,
) -> KVConfig:
    """The KV pool of ``cfg``'s heads (a rank's own under tensor parallelism); ``policy``:
    rank 0's offload, prefix-cache and length settings (the other ranks only hold pages)."""
    return KVConfig(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_pages=num_pages,
        page_size=config.page_size,
        dtype=dtype,
        device=str(device),
        layer_windows=cfg.layer_windows,
        **policy,
    )


def attention_resource(
    cache: KVCache, cfg: ModelConfig, config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> AttentionResource:
    """Paged attention over ``cache`` for ``cfg``'s heads (a rank's own under tensor
    parallelism); page 0 is the sink page (`PageArena`) on every rank."""
    backends = [  # one per KV group (`KVGroups`): a sliding group plans its own window
        select_attention_backend(
            device, config.attention_backend, dtype, deterministic=config.deterministic
        )
        for _ in cache.groups.labels
    ]
    return AttentionResource(
        cache,
        backends[0],
        num_qo_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        sink_page=SINK_PAGE,
        sm_scale=cfg.attn_scale,
        layer_windows=cfg.layer_windows,
        group_backends=backends[1:],
    )
