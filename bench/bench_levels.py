"""mstar at every CPU ISA level this machine runs: batch-1 decode and batch-32 throughput.

One build carries the kernels for every level and picks the best at load; a lower level is
what a CPU without the higher one gets. Each level runs in its own process with
`MSTAR_CPU_ISA` set and torch's oneDNN and ATen capped at the same level
(`bench_all.library_caps`), so one table on one machine shows every level's figures.

    python bench/bench_levels.py [--levels amx x86-64-v3] [--dtypes bfloat16 float32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_all import (  # noqa: E402  (bench/ is a folder of scripts, not a package)
    DTYPES,
    Report,
    library_caps,
    machine,
    mstar_batch1,
    offline_mstar,
    prompts,
)

from mstar.kernels import cpu_isa  # noqa: E402


def measure(folder: str, dtype: str, batch: int, new: int, repeat: int) -> dict[str, float]:
    """In the child: decode ms/token at batch 1 (llama-bench's way) and tok/s at ``batch``."""
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    one = mstar_batch1(folder, dtype, new, repeat)
    work = {batch: [prompts(batch, r, vocab, 0) for r in range(repeat)]}
    many = offline_mstar(folder, dtype, work, new)[batch]
    return {"decode_ms": 1000 / one["tg"], "prompt_tok_s": one["pp"], "batch_tok_s": max(many)}


def child(level: str, dtype: str, args: argparse.Namespace, folder: str) -> dict[str, float]:
    env = {**os.environ, cpu_isa.ENV_LEVEL: level}
    env.update(library_caps(cpu_isa.resolve(level)))
    argv = [sys.executable, __file__, "--child", dtype, "--model", folder,
            "--batch", str(args.batch), "--new-tokens", str(args.new_tokens),
            "--repeat", str(args.repeat)]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{level} {dtype} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", nargs="+", default=None, help="default: every level this CPU runs")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="best of this many")
    ap.add_argument("--model", default=None, help="converted model folder (default: SmolLM2)")
    ap.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/<time>-levels.md"
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one dtype, this process
    args = ap.parse_args()

    from mstar.engine.model.gguf_convert import default_model_path

    folder = args.model or str(default_model_path())
    if args.child:
        print(json.dumps(measure(folder, args.child, args.batch, args.new_tokens, args.repeat)))
        return
    supported = [lvl.name for lvl in cpu_isa.supported_levels()]
    names = args.levels or supported
    for name in names:
        try:
            level = cpu_isa.resolve(name)
        except ValueError as exc:
            ap.error(f"--levels: {exc}")
        if level.name not in supported:
            ap.error(f"--levels: this CPU does not run {level.name} (it runs {supported})")
    out = args.out or HERE / "results" / time.strftime("%Y%m%d-%H%M-levels.md", time.gmtime())
    report = Report(
        out,
        f"# mstar per CPU ISA level, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
        f"Machine: {machine()}. Load average (1 min) {os.getloadavg()[0]:.2f} at start. Each "
        f"level in its own process (`{cpu_isa.ENV_LEVEL}`; torch's oneDNN and ATen capped at "
        "the same level). Batch 1 timed as llama-bench times itself (decode: tokens "
        f"after a 1-token prompt; prompt: one 128-token step); batch {args.batch}: offline "
        f"random prompts of 20-200 tokens, {args.new_tokens} new tokens each. Best of "
        f"{args.repeat}.",
    )
    rows = []
    for dtype in args.dtypes:
        for name in names:
            got = child(name, dtype, args, folder)
            print(name, dtype, got, flush=True)
            rows.append([name, dtype, f"{got['decode_ms']:.1f}", f"{got['prompt_tok_s']:.0f}",
                         f"{got['batch_tok_s']:.1f}"])  # fmt: skip
    report.add(
        "Per level",
        ["level", "dtype", "decode ms/token, batch 1", "prompt tok/s (128)",
         f"tok/s, batch {args.batch}"],
        rows,
        f"load {os.getloadavg()[0]:.2f} after.",
    )  # fmt: skip


if __name__ == "__main__":
    main()
