"""Decode throughput table on a CUDA device: tok/s at batch 1, 8, 32, 64, CUDA graphs on and off.

The model is a random Llama with SmolLM2-135M's shapes (30 layers, hidden 576, 9/3 heads,
vocab 49152): the speed of a forward does not depend on the weights' values, and the real
checkpoint is not on the GPU machine. Only steps where every request decodes are timed (after
each batch's prefill), with a CUDA sync at both ends. Run by ``tests/gpu/first_run.sh``.

    python tests/gpu/bench_decode.py [--steps 64]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from models import build_tiny_model

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.sampling_params import SamplingParams

BATCHES = (1, 8, 32, 64)
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
)
SETTINGS = {
    "flashinfer, graphs on": dict(attention_backend="flashinfer"),
    "flashinfer, graphs off": dict(attention_backend="flashinfer", enforce_eager=True),
}


def decode_tok_per_s(engine: LLMEngine, batch: int, steps: int) -> float:
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}.{i}", [5 + (i * 17 + j) % 40000 for j in range(32)], params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill (and the first token) is not timed
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    folder = build_tiny_model(Path(tempfile.mkdtemp()) / "smollm2-shape", **SMOLLM2_135M)
    # Rows print as they finish, so a run cut short still reports what it measured.
    print(f"decode tok/s, {torch.cuda.get_device_name()}, bf16, {args.steps} timed steps")
    print("| setting | " + " | ".join(f"bs {b}" for b in BATCHES) + " | engine ready |")
    print("|---|" + "---|" * (len(BATCHES) + 1), flush=True)
    for name, extra in SETTINGS.items():
        cfg = EngineConfig(
            model=str(folder), dtype="bfloat16", device="cuda", num_pages=8192, **extra
        )  # type: ignore[arg-type]
        t0 = time.perf_counter()
        engine = LLMEngine.from_config(cfg)
        setup = time.perf_counter() - t0
        vals = [decode_tok_per_s(engine, b, args.steps) for b in BATCHES]
        cells = " | ".join(f"{v:,.0f}" for v in vals)
        print(f"| {name} | {cells} | {setup:.1f} s |", flush=True)
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
