"""bench/bench_gpu_shapes.py runs end to end on CPU in its tiny mode, so the device script that
calls it on CUDA cannot rot between device runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import bench_gpu_shapes


def test_tiny_cpu_run_reports_every_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "shapes.json"
    argv = [
        "bench_gpu_shapes.py",
        "--device", "cpu", "--tiny", "--shapes", "qwen2.5-0.5b", "llama-3.1-8b",
        "--batches", "1", "4", "--big-batches", "1", "--peer-batches", "1",
        "--steps", "3", "--warmup", "1", "--profile-steps", "1", "--hbm-gbps", "20",
        "--fp8-batches", "1",
        "--json", str(out),
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_gpu_shapes.main()
    printed = capsys.readouterr().out
    assert "| batch | mstar ms/step" in printed and "| batch | fp8 ms/step" in printed
    results = json.loads(out.read_text())
    assert results["device"] == "cpu" and results["hbm_gbps"] == 20
    qwen = results["shapes"]["qwen2.5-0.5b"]
    assert sorted(qwen["mstar"]) == ["1", "4"] and sorted(qwen["peer"]) == ["1"]
    assert qwen["floor_ms"] == qwen["weight_bytes"] / 20e9 * 1e3
    for figures in qwen["mstar"].values():
        assert figures["ms"] > 0 and figures["kernels"] > 0 and figures["busy_ms"] > 0
        assert figures["kernels_per_layer"] == figures["kernels"] / 2  # TINY: two layers
    # the 8B shape runs its own batch list (batch 1 by default on the device)
    assert sorted(results["shapes"]["llama-3.1-8b"]["mstar"]) == ["1"]
    # FP8 at load: the e4m3 projections read a byte per weight, so a smaller floor
    big = results["shapes"]["llama-3.1-8b"]
    assert sorted(big["fp8"]) == ["1"] and big["fp8"]["1"]["ms"] > 0
    assert 0 < big["fp8_weight_bytes"] < big["weight_bytes"]
    assert big["fp8_floor_ms"] == big["fp8_weight_bytes"] / 20e9 * 1e3
