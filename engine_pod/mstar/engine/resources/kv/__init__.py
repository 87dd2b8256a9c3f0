"""Paged KV cache resource: device tensor, refcounted page arena, prefix index, host tier."""

from mstar.engine.resources.kv.allocator import SINK_PAGE, PageAllocator, PageArena, PagesExhausted
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.config import KVConfig, KVRequestConfig, KVStep
from mstar.engine.resources.kv.groups import KVGroups
from mstar.engine.resources.kv.manager import MAIN_LABEL, KVCacheResource
from mstar.engine.resources.kv.plan import KVPlan, build_plan
from mstar.engine.resources.kv.prefix import PrefixIndex, chain_key

__all__ = [
    "MAIN_LABEL",
    "SINK_PAGE",
    "KVCache",
    "KVCacheResource",
    "KVConfig",
    "KVGroups",
    "KVPlan",
    "KVRequestConfig",
    "KVStep",
    "PageAllocator",
    "PageArena",
    "PagesExhausted",
    "PrefixIndex",
    "build_plan",
    "chain_key",
]
