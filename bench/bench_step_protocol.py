"""CPU cost of one scheduler step's resource protocol, per request, at decode.

Times what the engine does around every forward: declare the step (one `Segment` per request
plus the `SubmoduleStep`), then `StepRunner.admit` -> `plan` -> `commit` over the real
`KVCacheResource` and a no-op second resource. Every request decodes one token per step
(span=1), so pages fill and new ones are reserved as they would in serving; with the prefix
cache on (the default) filled pages are hashed and indexed at commit too. No model runs.

    python bench/bench_step_protocol.py [--batches 1 16 64 256] [--steps 300] [--repeat 5]
                                        [--no-prefix]
    python bench/bench_step_protocol.py --profile 256     # cProfile one batch size

Target: under 20 us per request per step at batch 256.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Callable

from mstar.engine.resources.base import Resource
from mstar.engine.resources.kv import KVCacheResource, KVConfig, KVRequestConfig
from mstar.engine.resources.runner import StepRunner
from mstar.engine.resources.step import ResourceStep, Segment, StepContext, SubmoduleStep

PAGE_SIZE = 16
PROMPT_BASE = 32
WARMUP = 20


class NoopResource(Resource):
    """A second declared resource that does nothing: isolates the runner's own sweep cost."""


def build(
    batch: int, steps: int, prefix: bool, device: str = "cpu"
) -> tuple[StepRunner, list[str], dict[str, list[int]]]:
    tokens_per_req = PROMPT_BASE + PAGE_SIZE + steps + WARMUP + 1
    pages = batch * (-(-tokens_per_req // PAGE_SIZE)) + 2
    kv = KVCacheResource(
        KVConfig(
            num_layers=1,
            num_kv_heads=1,
            head_dim=8,
            num_pages=pages,
            page_size=PAGE_SIZE,
            max_seq_len=tokens_per_req + PAGE_SIZE,
            enable_prefix_cache=prefix,
            device=device,
        )
    )
    runner = StepRunner({"kv": kv, "noop": NoopResource()})
    rids = [f"req-{i}" for i in range(batch)]
    tokens: dict[str, list[int]] = {}
    for i, rid in enumerate(rids):
        # Distinct prompts of staggered lengths: page boundaries don't all land on one step.
        tokens[rid] = [i * 7919 + t for t in range(PROMPT_BASE + i % PAGE_SIZE)]
        runner.ingest_request(rid, {"kv": KVRequestConfig(tokens[rid])})
    prefill = SubmoduleStep(
        {"kv": ResourceStep(), "noop": ResourceStep()},
        segments=[Segment(rid, "main", len(tokens[rid])) for rid in rids],
    )
    prefill.set_ctx(StepContext(request_ids=rids, graph_walk="prefill", slot=0, capture=False))
    assert runner.admit(prefill).ok
    runner.plan(prefill)
    runner.commit(prefill)
    return runner, rids, tokens


def run_steps(
    runner: StepRunner, rids: list[str], tokens: dict[str, list[int]], steps: int
) -> tuple[float, float, float, float]:
    """Returns total seconds spent in (declare, admit, plan, commit) over ``steps`` steps."""
    ctx = StepContext(request_ids=rids, graph_walk="decode", slot=0, capture=False)
    token_lists = [tokens[rid] for rid in rids]
    clock = time.perf_counter
    t_declare = t_admit = t_plan = t_commit = 0.0
    for step_no in range(steps):
        for lst in token_lists:  # the scheduler's append of the sampled token: not timed
            lst.append(step_no)
        t0 = clock()
        step = SubmoduleStep(
            {"kv": ResourceStep(), "noop": ResourceStep()},
            segments=[Segment(rid, "main", 1) for rid in rids],
        )
        step.set_ctx(ctx)
        t1 = clock()
        outcome = runner.admit(step)
        t2 = clock()
        if not outcome.ok:
            raise RuntimeError(f"admit refused in the benchmark: {outcome.reason}")
        runner.plan(step)
        t3 = clock()
        runner.commit(step)
        t4 = clock()
        t_declare += t1 - t0
        t_admit += t2 - t1
        t_plan += t3 - t2
        t_commit += t4 - t3
    return t_declare, t_admit, t_plan, t_commit


def measure(
    batch: int, steps: int, prefix: bool, repeat: int, device: str = "cpu"
) -> tuple[float, float, float, float]:
    """Best of ``repeat`` fresh runs (by total): other processes on the host only add time."""
    best: tuple[float, float, float, float] | None = None
    for _ in range(repeat):
        runner, rids, tokens = build(batch, steps, prefix, device)
        run_steps(runner, rids, tokens, WARMUP)
        parts = run_steps(runner, rids, tokens, steps)
        if best is None or sum(parts) < sum(best):
            best = parts
    assert best is not None
    return best


def profile(batch: int, steps: int, prefix: bool) -> None:
    runner, rids, tokens = build(batch, steps, prefix)
    run_steps(runner, rids, tokens, WARMUP)
    prof = cProfile.Profile()
    fn: Callable[[], object] = lambda: run_steps(runner, rids, tokens, steps)  # noqa: E731
    prof.runcall(fn)
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=5, help="report the best of N runs")
    parser.add_argument("--device", default="cpu", help="cache device (cuda adds the slot copy)")
    parser.add_argument("--no-prefix", action="store_true", help="disable the prefix cache")
    parser.add_argument("--profile", type=int, metavar="BATCH", help="cProfile one batch size")
    args = parser.parse_args()
    prefix = not args.no_prefix
    if args.profile:
        profile(args.profile, args.steps, prefix)
        return
    print(
        f"decode steps (span=1), page_size={PAGE_SIZE}, prefix cache {'on' if prefix else 'off'}"
        f", device {args.device}, best of {args.repeat} runs x {args.steps} steps"
    )
    print(f"{'batch':>6} {'declare':>9} {'admit':>9} {'plan':>9} {'commit':>9} {'total':>9}")
    print(f"{'':>6} {'(us per request per step)':>49}")
    for batch in args.batches:
        parts = measure(batch, args.steps, prefix, args.repeat, args.device)
        per = [t / (args.steps * batch) * 1e6 for t in parts]
        cells = " ".join(f"{p:9.2f}" for p in per)
        print(f"{batch:>6} {cells} {sum(per):9.2f}")


if __name__ == "__main__":
    main()
