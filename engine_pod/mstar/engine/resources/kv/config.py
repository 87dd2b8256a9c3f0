"""Configuration values of the paged KV cache, and the per-request override it accepts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mstar.engine.resources.kv.groups import KVGroups
from mstar.engine.resources.step import ResourceStep

__all__ = ["KVConfig", "KVRequestConfig", "KVStep", "pages_for"]


def pages_for(num_tokens: int, page_size: int) -> int:
    """Whole pages that hold ``num_tokens`` tokens (ceiling division)."""
    return (num_tokens + page_size - 1) // page_size


@dataclass
class KVConfig:
    """Shape and policy of one node's KV cache.

    ``num_pages`` counts every page of the device tensor; with ``reserve_sink_page`` page 0 is
    taken out of circulation (a captured graph's padding rows write into it), so the usable pool
    is one page smaller.

    ``async_copy`` runs offload/reload copies on a copy-worker thread (a dedicated CUDA stream
    on GPU): the call claims the pages and returns, the copy lands later. False completes each
    offload/reload inside the call (claim, copy, commit on the caller's thread).

    ``layer_windows`` (per layer, 0: full) splits a hybrid model's layers into KV groups
    (`KVGroups`, set as ``groups``): a page then holds ``groups.slots`` layers, not all of them.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    max_seq_len: int = 4096
    host_offload_pages: int = 0
    enable_prefix_cache: bool = False
    reserve_sink_page: bool = True
    async_copy: bool = True
    layer_windows: tuple[int, ...] = ()
    groups: KVGroups = field(init=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVConfig.{name} must be at least 1, got {getattr(self, name)}")
        minimum = 2 if self.reserve_sink_page else 1
        if self.num_pages < minimum:
            raise ValueError(
                f"KVConfig.num_pages must be at least {minimum}, got {self.num_pages}"
                + (" (page 0 is the sink page)" if self.reserve_sink_page else "")
            )
        if self.host_offload_pages < 0:
            raise ValueError("KVConfig.host_offload_pages must be >= 0 (0 = no host tier)")
        self.groups = KVGroups.for_layers(self.num_layers, self.layer_windows)
        if self.groups.hybrid and not self.reserve_sink_page:
            raise ValueError("KVConfig: sliding-window KV groups need the sink page (their holes)")

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - (1 if self.reserve_sink_page else 0)


@dataclass
class KVRequestConfig:
    """Per-request KV override handed to `ingest_request`.

    ``token_ids`` is a read-only live view of the request's tokens (prompt + generated; the
    request appends to it). The cache never copies it: at commit it reads the tokens of each
    newly filled page to key the prefix index.
    """

    token_ids: Sequence[int]
    #: the root of the request's prefix-cache chain: requests whose KV differs for the same
    #: tokens (a LoRA adapter's) key their pages from their own root, so they never share
    #: pages with the base model's or another adapter's (b"": the base model's chain)
    cache_salt: bytes = b""


@dataclass
class KVStep(ResourceStep):
    """A KV step; ``commit=False`` reads the streams without advancing them at commit."""

    commit: bool = True
