"""Where the engine's host waits for the device: every synchronising call of a few steps, a table.

torch's sync debug mode warns at each call that blocks the host until the device catches up
(``.tolist()``, ``.item()``, a synchronous copy). One step must wait once, to read the sampled
tokens back; any other wait keeps the host from planning the next step while the forward runs.
Runs the engine on a random model with SmolLM2-135M's shapes (FlashInfer, CUDA graphs): 8
decode steps at batch 1 and 8, then a long prompt chunked over prefill-only steps.

    python tests/gpu/sync_points.py
"""

from __future__ import annotations

import argparse
import tempfile
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
from bench_decode import SMOLLM2_135M
from models import build_tiny_model

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.sampling_params import SamplingParams


def _where() -> str:
    """The innermost engine frame of the current stack (file:line function)."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/mstar/" in frame.filename and "warnings" not in frame.filename:
            return f"{frame.filename.split('/mstar/')[-1]}:{frame.lineno} {frame.name}"
    return "outside mstar"


def _steps(engine: LLMEngine, n: int, seen: Counter[str], phase: str) -> None:
    def record(*_: object, **__: object) -> None:
        seen[f"{phase}: {_where()}"] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning on the way out
            warnings.simplefilter("always")
            warnings.showwarning = record
            for _ in range(n):
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    folder = build_tiny_model(Path(tempfile.mkdtemp()) / "smollm2-shape", **SMOLLM2_135M)
    cfg = EngineConfig(
        model=str(folder),
        dtype="bfloat16",
        device="cuda",
        num_pages=4096,
        attention_backend="flashinfer",
        max_num_batched_tokens=64,
        step_budget="fixed",
    )
    engine = LLMEngine.from_config(cfg)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    seen: Counter[str] = Counter()
    for batch in (1, 8):
        for i in range(batch):
            engine.add_request(f"d{batch}.{i}", [5 + i + j for j in range(16)], params)
        for _ in range(4):
            engine.step()  # prefill and warm-up, not counted
        _steps(engine, 8, seen, f"decode bs{batch} (8 steps)")
        while engine.has_unfinished_requests():
            engine.step()
    engine.add_request("long", [7 + j % 900 for j in range(640)], params)
    engine.step()
    _steps(engine, 8, seen, "prefill-only (8 steps)")
    print(f"host waits for the device, by engine frame, {torch.cuda.get_device_name()}")
    print("| phase: where | waits |\n|---|---:|")
    for key, count in sorted(seen.items()):
        print(f"| {key} | {count} |")


if __name__ == "__main__":
    main()
