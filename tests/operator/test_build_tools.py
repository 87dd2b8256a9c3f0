"""`scripts/cluster.sh build-tools` names what it builds and refuses what it does not know."""

from __future__ import annotations

import subprocess

from built_tools import CLUSTER_SH


def test_an_unknown_tool_is_refused_by_name() -> None:
    proc = subprocess.run(
        ["bash", str(CLUSTER_SH), "build-tools", "keda"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert "no tool keda (epp, jaeger, adapter, lws)" in proc.stderr
    assert proc.stdout == ""  # nothing built, no bin folder printed
