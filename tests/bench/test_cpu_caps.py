"""bench/peers/cpu_caps: a peer capped at mstar's forced ISA level sees no more of the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.bench_all import PEER_CAPS, TORCH_CAPS, vllm_env
from bench.peers.cpu_caps.sitecustomize import PROBES

PROBE_ALL = (
    f"import json, torch.cpu; probes = {PROBES!r}; "
    "print(json.dumps({n: getattr(torch.cpu, p)() for n, p in probes.items()}))"
)


def probes(env: dict[str, str]) -> dict[str, bool]:
    """What torch.cpu reports in a fresh interpreter started with ``env`` (as vLLM's are)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE_ALL], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def real_probes() -> dict[str, bool]:
    """torch's own answers: no shim on the path."""
    env = {k: v for k, v in os.environ.items() if k not in (PEER_CAPS, "PYTHONPATH")}
    return probes(env)


def test_a_forced_level_hides_what_it_lacks_in_every_new_process(monkeypatch) -> None:
    real = real_probes()
    monkeypatch.setenv(PEER_CAPS, TORCH_CAPS["x86-64-v3"][2])
    capped = probes(vllm_env())
    assert capped == {name: name == "avx2" and real["avx2"] for name in PROBES}


def test_every_probe_stays_true_where_the_level_has_it(monkeypatch) -> None:
    real = real_probes()
    monkeypatch.setenv(PEER_CAPS, ",".join(PROBES))
    assert probes(vllm_env()) == real


def test_no_forced_level_leaves_vllm_uncapped(monkeypatch) -> None:
    monkeypatch.delenv(PEER_CAPS, raising=False)
    assert vllm_env()["PYTHONPATH"] == ""
