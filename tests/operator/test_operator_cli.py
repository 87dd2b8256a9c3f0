"""`mstar-operator` as the README's first command installs it: without the `operator` extra."""

from __future__ import annotations

import os
import subprocess
import sys

from op_harness import ROOT

# Run the console script's entry point with kopf unimportable, as in an environment that has
# only the main dependencies (`pip install -e .`).
WITHOUT_KOPF = """
import sys
sys.modules["kopf"] = None  # makes `import kopf` raise ModuleNotFoundError
from mstar.operator.main import main
main([])
"""


def test_missing_operator_extra_is_a_clear_message_not_a_traceback() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "engine_pod"), str(ROOT / "operator")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_KOPF], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        "mstar-operator: the Python package 'kopf' is missing; the operator needs its extra: "
        "pip install 'mstar[operator]' (or -e '.[operator]' in a checkout)"
    )
