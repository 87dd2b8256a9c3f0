"""Offline decode tok/s with the overlap loop on and off (`--async-scheduling`), same engine.

Greedy, `--new` tokens per request (ignore_eos), `--batches` prompts at once, best of
`--repeat`, the modes interleaved so load drift hits both. Run under the heavy lock:

    flock /tmp/mstar-heavy.lock python3 bench/bench_overlap_cpu.py [--batches 1 32]

On a tree without the flag (main before it), ``--modes main`` runs its only loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.sampling_params import SamplingParams


def build(mode: str, max_num_seqs: int) -> LLMEngine:
    kw: dict[str, object] = {"device": "cpu", "max_num_seqs": max_num_seqs}
    if mode != "main":
        assert "async_scheduling" in {f.name for f in dataclasses.fields(EngineConfig)}
        kw["async_scheduling"] = "on" if mode == "overlap" else "off"
    return LLMEngine.from_config(EngineConfig(**kw))  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["sync", "overlap"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(0)
    engines = {m: build(m, max(args.batches)) for m in args.modes}
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    for e in engines.values():
        e.generate([[100, 200, 300]], params)  # warm-up
    print("| batch | " + " | ".join(f"{m} tok/s" for m in args.modes) + " |")
    print("|---:|" + "---:|" * len(args.modes))
    for batch in args.batches:
        best = dict.fromkeys(args.modes, 0.0)
        outs: dict[str, list[list[int]]] = {}
        for _ in range(args.repeat):
            lengths = [rng.randint(20, 200) for _ in range(batch)]
            prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]
            for mode, engine in engines.items():
                start = time.perf_counter()
                outs[mode] = engine.generate(prompts, params)
                best[mode] = max(best[mode], batch * args.new / (time.perf_counter() - start))
            first = next(iter(outs.values()))
            assert all(o == first for o in outs.values()), "modes disagree on greedy tokens"
        print(f"| {batch} | " + " | ".join(f"{best[m]:.1f}" for m in args.modes) + " |")


if __name__ == "__main__":
    main()
