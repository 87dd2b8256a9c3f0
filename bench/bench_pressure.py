"""Memory pressure: mstar (recompute-only, and with host offload) beside vLLM-CPU, same KV pool.

A fixed workload (64 requests, prompts of 100-400 random tokens, 64-128 new tokens each with
ignore_eos, all submitted at once) on a device KV pool holding about a quarter of its peak
demand (the sum of every request's prompt + output tokens). Both engines get the same KV tokens:
mstar `num_pages` of 16 tokens, vLLM `num_gpu_blocks_override` blocks of 32 (its CPU attention
takes no smaller block), and the same `max_num_seqs`, `max_model_len` and
token budget, prefix caching off, SmolLM2-135M-Instruct from the same converted folder in the
same dtype (`--dtype`, bf16 by default).
vLLM runs in its own virtual environment (`bench/peers/setup_vllm.sh`), in a subprocess, with
`VLLM_CPU_NUM_OF_RESERVED_CPU=0` (both cores compute, its best configuration here); mstar uses
torch's default of one OpenMP thread per core. Reports wall time, output tokens/s, evictions per
request (vLLM: preemptions) and p50/p99 end-to-end latency, best of `--repeat` runs by wall time.

    python bench/bench_pressure.py [--requests 64] [--repeat 3] [--dtype float32]
        [--engines ...] [--json bench/results/pressure.json] [--out bench/results/pressure.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.model.gguf_convert import default_model_path
from mstar.engine.sampling_params import SamplingParams

PAGE = 16
SMOLLM2_VOCAB = 49152
#: vLLM-CPU's attention takes blocks of a multiple of 32 tokens: same capacity, half the blocks.
VLLM_BLOCK = 32
#: Set from --dtype (both engines run the same weights in the same dtype).
DTYPE = ["bfloat16"]
#: Both engines: longer than any request (400 + 128 tokens), so vLLM accepts the small pool.
MAX_MODEL_LEN = 1024
ENGINES = ("mstar recompute-only", "mstar + host offload", "vLLM-CPU")
HERE = Path(__file__).resolve().parent


@dataclass
class Run:
    wall_s: float
    output_tokens: int
    evictions: float
    e2e_s: list[float]


def workload(n: int, seed: int, vocab: int) -> list[dict]:
    """The fixed workload; ids are drawn for SmolLM2's vocabulary and folded into a smaller one,
    so every model sees the same lengths."""
    rng = random.Random(seed)
    return [
        {
            "prompt_token_ids": [
                rng.randrange(100, SMOLLM2_VOCAB) % vocab for _ in range(rng.randint(100, 400))
            ],
            "max_tokens": rng.randint(64, 128),
        }
        for _ in range(n)
    ]


def run_mstar(
    folder: str, requests: list[dict], pages: int, host_gb: float, seqs: int, budget: int
) -> Run:
    engine = LLMEngine.from_config(
        EngineConfig(
            model=folder,
            dtype=DTYPE[0],
            device="cpu",
            num_pages=pages + 1,  # + the sink page, so both engines get `pages` usable pages
            page_size=PAGE,
            max_num_seqs=seqs,
            max_num_batched_tokens=budget,
            host_offload_gb=host_gb,
            enable_prefix_caching=False,
            max_model_len=MAX_MODEL_LEN,
        )
    )
    engine.generate([requests[0]["prompt_token_ids"][:8]], SamplingParams(max_tokens=2))  # warm
    before = engine.counters.evictions
    start = time.perf_counter()
    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
        engine.add_request(str(i), r["prompt_token_ids"], params)
    e2e: dict[str, float] = {}
    tokens: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                if out.error is not None:
                    raise SystemExit(f"mstar request {out.request_id} failed: {out.error}")
                e2e[out.request_id] = time.perf_counter() - start
                tokens[out.request_id] = out.num_output_tokens
    wall = time.perf_counter() - start
    got = [tokens[str(i)] for i in range(len(requests))]
    if got != [r["max_tokens"] for r in requests]:
        raise SystemExit("mstar did not produce exactly max_tokens for every request")
    return Run(
        wall,
        sum(got),
        engine.counters.evictions - before,
        [e2e[str(i)] for i in range(len(requests))],
    )


def run_vllm(
    folder: str, requests: list[dict], pages: int, seqs: int, budget: int, repeat: int
) -> list[Run]:
    python = subprocess.run(
        ["bash", str(HERE / "peers" / "setup_vllm.sh")], check=True, capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        spec.write_text(
            json.dumps(
                {
                    "model": folder,
                    "dtype": DTYPE[0],
                    "block_size": VLLM_BLOCK,
                    "num_blocks": pages * PAGE // VLLM_BLOCK,
                    "max_num_seqs": seqs,
                    "max_num_batched_tokens": budget,
                    "max_model_len": MAX_MODEL_LEN,
                    "repeat": repeat,
                    "requests": requests,
                }
            )
        )
        env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
        subprocess.run(
            [python, str(HERE / "peers" / "vllm_pressure.py"), str(spec), str(result)],
            check=True,
            env=env,
            cwd=tmp,
        )
        runs = json.loads(result.read_text())["runs"]
    return [Run(**r) for r in runs]


def percentile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def table(results: dict[str, Run], n: int, pages: int, peak: int) -> str:
    peer = results.get("vLLM-CPU")
    lines = [
        f"{n} requests, peak demand {peak} tokens, device KV {pages} pages x {PAGE} tokens "
        f"= {pages * PAGE} tokens ({pages * PAGE / peak:.2f} of peak); best of runs by wall time.",
        "",
        "| engine | wall s | output tok/s | evictions/request | p50 e2e s | p99 e2e s "
        "| tok/s vs vLLM |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        tps = r.output_tokens / r.wall_s
        ratio = f"{tps / (peer.output_tokens / peer.wall_s):.2f}x" if peer else "n/a"
        lines.append(
            f"| {name} | {r.wall_s:.1f} | {tps:.1f} | {r.evictions / n:.2f} | "
            f"{percentile(r.e2e_s, 50):.1f} | {percentile(r.e2e_s, 99):.1f} | {ratio} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fraction", type=float, default=0.25, help="device KV / peak demand")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--host-offload-gb", type=float, default=1.0)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument(
        "--model",
        default=None,
        help="HF folder (default: the packaged SmolLM2). Scheduling does not depend on the "
        "weights (ignore_eos, fixed lengths), so a tiny model replays the same admissions fast",
    )
    ap.add_argument(
        "--engines",
        nargs="+",
        default=list(ENGINES),
        choices=ENGINES,
        help="which to run now; results of the others are read from --json if there",
    )
    ap.add_argument("--json", type=Path, default=None, help="results store (kept across runs)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args()

    DTYPE[0] = args.dtype
    folder = args.model or str(default_model_path())
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    requests = workload(args.requests, args.seed, vocab)
    peak = sum(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests)
    pages = int(peak * args.fraction) // PAGE
    common = (folder, requests, pages)
    limits = (args.max_num_seqs, args.max_num_batched_tokens)

    results: dict[str, Run] = {}
    if args.json is not None and args.json.exists():
        results = {k: Run(**v) for k, v in json.loads(args.json.read_text()).items()}
    for name in args.engines:
        if name == "vLLM-CPU":
            runs = run_vllm(*common, *limits, args.repeat)
        else:
            host_gb = 0.0 if name == "mstar recompute-only" else args.host_offload_gb
            runs = [run_mstar(*common, host_gb, *limits) for _ in range(args.repeat)]
        results[name] = min(runs, key=lambda r: r.wall_s)
        print(name, [f"{r.wall_s:.1f}s" for r in runs], flush=True)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({k: vars(v) for k, v in results.items()}))
    results = {k: results[k] for k in ENGINES if k in results}

    text = f"dtype {args.dtype}. " + table(results, args.requests, pages, peak)
    cpu = platform.processor() or platform.machine()
    machine = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"
    text += f"\n\nMachine: {machine}; load before start {os.getloadavg()[0]:.2f}.\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
