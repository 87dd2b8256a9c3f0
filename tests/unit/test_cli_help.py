"""Every console script the package installs, and each of its subcommands, answers `--help`
with exit 0 (a literal % in one help string used to crash `mstar-engine serve --help`).

The scripts come from pyproject.toml's [project.scripts] and each runs as its entry point
would, in a fresh interpreter; subcommands come from the script's own parser.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _subcommands(entry: str) -> list[str]:
    """The subcommand names of the script's parser (its module's `build_parser`)."""
    module = importlib.import_module(entry.split(":")[0])
    parser: argparse.ArgumentParser = module.build_parser()
    names: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            names.extend(action.choices)
    return names


def _cases() -> list[tuple[str, list[str]]]:
    cases = []
    for script, entry in sorted(SCRIPTS.items()):
        cases.append((script, []))
        cases.extend((script, [sub]) for sub in _subcommands(entry))
    return cases


def _run_help(
    entry: str, args: list[str], cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``entry`` (``module:function``) as its console script would, with ``--help``."""
    module, func = entry.split(":")
    code = f"import sys; from {module} import {func}; sys.exit({func}())"
    return subprocess.run(
        [sys.executable, "-c", code, *args, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_the_scripts_and_their_subcommands_are_found() -> None:
    assert {"mstar-engine", "mstar-operator"} <= set(SCRIPTS)
    assert {("mstar-engine", ("serve",)), ("mstar-engine", ("prestop",))} <= {
        (script, tuple(args)) for script, args in _cases()
    }


@pytest.mark.parametrize(
    ("script", "args"), _cases(), ids=lambda v: v if isinstance(v, str) else " ".join(v)
)
def test_help_exits_zero(script: str, args: list[str]) -> None:
    done = _run_help(SCRIPTS[script], args)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and not done.stderr


def test_a_help_that_crashes_is_caught(tmp_path: Path) -> None:
    """The check fails for the old bug: a help string with a bare % in it."""
    (tmp_path / "brokencli.py").write_text(
        "import argparse\n"
        "def main():\n"
        "    p = argparse.ArgumentParser()\n"
        "    p.add_argument('--x', help='within 5% offline')\n"
        "    p.parse_args()\n"
    )
    done = _run_help("brokencli:main", [], cwd=tmp_path)  # `-c` puts the cwd on sys.path
    assert done.returncode != 0 and "TypeError" in done.stderr


@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-m", "mstar.kernels.build", "--help"],
        ["bash", str(ROOT / "scripts" / "cluster.sh"), "--help"],
        [sys.executable, str(ROOT / "bench" / "bench_all.py"), "--help"],
    ],
    ids=["mstar.kernels.build", "cluster.sh", "bench_all.py"],
)
def test_the_other_commands_answer_help(command: list[str]) -> None:
    """The module and script CLIs the READMEs name answer --help with exit 0 and build nothing."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "usage" in done.stdout.lower() or "scripts/cluster.sh build" in done.stdout
