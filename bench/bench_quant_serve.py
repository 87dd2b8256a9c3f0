"""The default model served from its Q4_1 file as stored: resident memory against today's bf16
path, and serving throughput against llama-server on the same file.

RSS: `mstar-engine serve` started on the packaged ``SmolLM2-135M-Instruct.Q4_1.gguf``
(``--quantization auto``, the projections kept in their blocks) and on the default model folder
(the conversion, served bf16), the same KV pages each; after a warmup of a few completions the
server's VmRSS (/proc/<pid>/status, the process and its children). Both pairs: the default
``--dtype auto`` (float32 activations and, by ``--kv-cache-dtype auto``, a bf16 KV cache for the
stored file, bf16 for the folder on a CPU with bf16 math; the stored file's float32 cache as a
third row) and ``--dtype bfloat16`` given to both.

Serving (``--serve``): the same closed-loop client against each server in turn (mstar on the
Q4_1 file, mstar on today's default bf16 folder, llama-server on the Q4_1 file): at each
concurrency, that many workers post completions (a fixed 143-word prompt, ``--max-tokens``
tokens, ignore_eos) until ``--requests`` have been answered; output tok/s = tokens / wall time,
best of ``--repeat``. llama-server (build 11434) gets a slot per worker, the same thread count.

Offline batches (``--offline``): mstar's engine in-process on the Q4_1 file (bf16
activations), ``generate`` of ``--batches`` copies of the prompt at once, against llama-server
answering the same batch as one wave of that many concurrent requests (its offline batch: a slot
each); output tok/s, best of ``--repeat``.

    flock /tmp/mstar-heavy.lock nice -n -15 python bench/bench_quant_serve.py --serve
    flock /tmp/mstar-heavy.lock nice -n -15 python bench/bench_quant_serve.py --no-rss --offline
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from mstar.engine.model.gguf_convert import find_packaged_gguf

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_all import (  # noqa: E402  (bench/ is a folder of scripts, not a package)
    llama_cpp_bin,
    machine,
    mstar_engine,
    tree_status_bytes,
    wait_ready,
)

PORT = 8131
URL = f"http://127.0.0.1:{PORT}"
NAME = "bench-model"
#: KV pages given to mstar either way (16 tokens each): room for 32 requests of 200 tokens
PAGES = 512
PROMPT = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 11)


def start(
    kind: str, model: str | None, slots: int, dtype: str = "auto", kv: str = "auto"
) -> subprocess.Popen[bytes]:
    log = Path(tempfile.gettempdir()) / f"mstar-bench-quant-{kind}.log"
    if kind == "llama.cpp":
        cmd = [str(llama_cpp_bin() / "llama-server"), "-m", str(model), "--alias", NAME]
        cmd += ["--host", "127.0.0.1", "--port", str(PORT), "--parallel", str(slots)]
        cmd += ["--ctx-size", str(slots * 512), "--threads", str(os.cpu_count())]
        cmd += ["--no-cache-prompt", "--cache-ram", "0", "--no-webui"]
    else:
        cmd = [sys.executable, "-m", "mstar.engine.cli", "serve", *([model] if model else [])]
        cmd += [f"--port={PORT}", f"--served-model-name={NAME}", f"--num-pages={PAGES}"]
        cmd += ["--log-level=warning", "--no-enable-prefix-caching", "--max-num-seqs=64"]
        cmd += [f"--quantization={kind}", f"--dtype={dtype}", f"--kv-cache-dtype={kv}"]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    wait_ready(URL, proc, log)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def load(concurrency: int, requests: int, max_tokens: int) -> float:
    """Output tok/s of ``requests`` completions posted by ``concurrency`` workers."""
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    left = requests
    tokens = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal left, tokens
        while left > 0:
            left -= 1
            async with session.post(URL + "/v1/completions", json=body) as r:
                answer = await r.json()
                if r.status != 200:
                    raise SystemExit(f"HTTP {r.status}: {answer}")
                tokens += int(answer["usage"]["completion_tokens"])

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        start_t = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return tokens / (time.perf_counter() - start_t)


def rss_row(kind: str, model: str | None, dtype: str, kv: str = "auto") -> int:
    proc = start(kind, model, 1, dtype, kv)
    try:
        asyncio.run(load(2, 4, 16))
        return tree_status_bytes(proc.pid, "VmRSS")
    finally:
        stop(proc)


def offline(gguf: str, batches: list[int], max_tokens: int, repeat: int) -> dict[int, float]:
    """mstar's offline tok/s on the file, per batch of copies of the prompt, best of repeat."""
    from mstar.engine.sampling_params import SamplingParams

    engine = mstar_engine(gguf, "bfloat16", max(batches))
    ids = engine.tokenizer.backend.encode(PROMPT).ids
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([ids], params)  # warm-up
    best: dict[int, float] = {}
    for batch in batches:
        for _ in range(repeat):
            start_t = time.perf_counter()
            outs = engine.generate([ids] * batch, params)
            rate = sum(len(o) for o in outs) / (time.perf_counter() - start_t)
            best[batch] = max(best.get(batch, 0.0), rate)
    return best


def serve_cells(gguf: str, args: argparse.Namespace) -> None:
    results: dict[str, dict[int, float]] = {}
    for kind in ("auto", "none", "llama.cpp"):  # none: today's default, the bf16 folder
        proc = start(kind, None if kind == "none" else gguf, max(args.concurrency))
        try:
            asyncio.run(load(2, 4, 16))  # warmup
            results[kind] = {
                c: max(asyncio.run(load(c, max(args.requests, c), args.max_tokens))
                       for _ in range(args.repeat))
                for c in args.concurrency
            }  # fmt: skip
            print(kind, results[kind], flush=True)
        finally:
            stop(proc)
    print(f"\nload {os.getloadavg()[0]:.2f}\n")
    print("| concurrency | mstar Q4_1 tok/s | mstar bf16 (default) | llama-server Q4_1 "
          "| Q4_1 / llama-server | Q4_1 / bf16 |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for c in args.concurrency:
        a, d, b = results["auto"][c], results["none"][c], results["llama.cpp"][c]
        print(f"| {c} | {a:.1f} | {d:.1f} | {b:.1f} | {a / b:.2f}x | {a / d:.2f}x |")


def offline_cells(gguf: str, args: argparse.Namespace) -> None:
    mstar_offline = offline(gguf, args.batches, args.max_tokens, args.repeat)
    print("mstar offline", mstar_offline, flush=True)
    proc = start("llama.cpp", gguf, max(args.batches))
    try:
        asyncio.run(load(2, 4, 16))  # warmup
        waves = {
            b: max(asyncio.run(load(b, b, args.max_tokens)) for _ in range(args.repeat))
            for b in args.batches
        }
        print("llama-server waves", waves, flush=True)
    finally:
        stop(proc)
    print(f"\nload {os.getloadavg()[0]:.2f}\n")
    print("| batch | mstar offline Q4_1 tok/s | llama-server Q4_1, one wave | ratio |")
    print("|---:|---:|---:|---:|")
    for b in args.batches:
        ours, theirs = mstar_offline[b], waves[b]
        print(f"| {b} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="serving against llama-server")
    parser.add_argument("--offline", action="store_true", help="offline batches against it")
    parser.add_argument("--no-rss", action="store_true", help="skip the RSS rows")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    gguf = str(find_packaged_gguf())
    print(f"{machine()}; load {os.getloadavg()[0]:.2f}\n")
    if not args.no_rss:
        print("| served | `--dtype` | VmRSS after warmup (MiB) | vs bf16 |\n|---|---|---:|---:|")
        for dtype in ("auto", "bfloat16"):
            dense, quant = rss_row("none", None, dtype), rss_row("auto", gguf, dtype)
            print(f"| the default model folder (bf16) | {dtype} | {dense / 2**20:.0f} | 1.00 |")
            print(f"| the Q4_1 file as stored | {dtype} | {quant / 2**20:.0f} "
                  f"| {quant / dense:.2f} |")  # fmt: skip
            if dtype == "auto":  # the float32 cache auto chose before --kv-cache-dtype
                f32 = rss_row("auto", gguf, dtype, "float32")
                print(f"| the Q4_1 file as stored, `--kv-cache-dtype float32` | {dtype} "
                      f"| {f32 / 2**20:.0f} | {f32 / dense:.2f} |")  # fmt: skip
    if args.serve:
        serve_cells(gguf, args)
    if args.offline:
        offline_cells(gguf, args)


if __name__ == "__main__":
    main()
