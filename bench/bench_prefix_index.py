"""Cost of the prefix index's hot paths at a large index size.

Fills a `KVCacheResource` whose pool is exactly the index (``--entries`` pages, page size 1,
chains of ``--chain`` pages, all idle once their writers are gone), then times what the engine
does with it every step or on every shortfall:

- ``usage`` / ``num_cached_pages`` (read by `engine.stats()` each step),
- ``evict_prefix_cache(1)`` (drop one LRU leaf),
- an admit of one new page on a full pool (the shortfall path: evict, then allocate).

Reports µs per call, best of ``--repeat`` rounds. Pure CPU, no model.

    python3 bench/bench_prefix_index.py [--entries 100000] [--chain 100] [--calls 200]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from mstar.engine.resources.kv import KVCacheResource, KVConfig, KVRequestConfig
from mstar.engine.resources.step import ResourceStep, Segment, StepContext

CTX = StepContext(request_ids=[], graph_walk="prefill", slot=0, capture=False)


def build(entries: int, chain: int) -> KVCacheResource:
    kv = KVCacheResource(
        KVConfig(
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            num_pages=entries + 1,
            page_size=1,
            max_seq_len=chain,
            enable_prefix_cache=True,
        )
    )
    for i in range(entries // chain):
        rid = f"fill{i}"
        kv.ingest_request(rid, KVRequestConfig([i] + [0] * (chain - 1)))
        step = ResourceStep(segments=(Segment(rid, "main", chain),))
        assert kv.admit(step, CTX).ok
        kv.commit(step, CTX)
        kv.remove_request(rid)
    assert kv.num_prefix_pages == entries and kv.num_cached_pages == entries
    return kv


def per_call_us(fn: Callable[[int], object], calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - start) / calls * 1e6


def one_round(entries: int, chain: int, calls: int) -> dict[str, float]:
    kv = build(entries, chain)

    def admit_on_full_pool(i: int) -> None:
        rid = f"new{i}"
        kv.ingest_request(rid)
        assert kv.admit(ResourceStep(segments=(Segment(rid, "main", 1),)), CTX).ok

    assert kv.num_free_pages == 0
    return {
        "admit with 1-page shortfall": per_call_us(admit_on_full_pool, calls),
        "usage": per_call_us(lambda _: kv.usage, calls),
        "num_cached_pages": per_call_us(lambda _: kv.num_cached_pages, calls),
        "evict_prefix_cache(1)": per_call_us(lambda _: kv.evict_prefix_cache(1), calls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--chain", type=int, default=100)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    results: dict[str, float] = {}
    for _ in range(args.repeat):
        for name, us in one_round(args.entries, args.chain, args.calls).items():
            results[name] = min(us, results.get(name, us))

    print(f"prefix index: {args.entries} entries, chains of {args.chain}, best of {args.repeat}")
    print(f"{'operation':<30} {'µs/call':>12}")
    for name, us in results.items():
        print(f"{name:<30} {us:>12.1f}")


if __name__ == "__main__":
    main()
