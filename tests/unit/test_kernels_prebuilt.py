"""Without a C++ compiler (the engine image) the kernels load from a prebuilt build of the same
sources and torch, whichever compiler made it; with none there, the engine logs why and keeps
the torch path, as it does when a build fails."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from external_tools import require_tool

from mstar.kernels import build, cpu_isa, cpu_kernels

#: run in a fresh process, as a pod starts: load, then one kernel against torch
_LOAD_AND_RUN = """
import json, logging, torch
logging.basicConfig(level=logging.INFO)
from mstar.kernels import cpu_kernels
ext = cpu_kernels.load()
x = torch.randn(8, 3000)
gate_up = torch.randn(4, 256)
gate, up = gate_up.chunk(2, dim=-1)
print(json.dumps({
    "level": cpu_kernels.loaded_level(),
    "argmax": torch.equal(ext.argmax_rows(x), x.argmax(dim=1)),
    "silu_mul": torch.allclose(ext.silu_mul(gate_up), torch.nn.functional.silu(gate) * up),
}))
"""


@pytest.fixture()
def no_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """CXX names a program that does not exist; the cache root is an empty folder (returned)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv(build.ENV_CACHE, str(cache))
    build._compiler.cache_clear()
    yield cache
    build._compiler.cache_clear()  # later tests ask the real compiler again


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_without_a_compiler_a_prebuilt_build_loads_and_runs(tmp_path: Path) -> None:
    require_tool("g++")
    level = cpu_isa.chosen_level()
    build.build([level])  # with this machine's compiler, in the suite's cache
    made_here = build.library_path(level)
    # As the image's build stage leaves it: only the library, under a compiler key of its own.
    cache = tmp_path / "cache"
    prebuilt = cache / build.source_key() / "another-compiler" / made_here.name
    prebuilt.parent.mkdir(parents=True)
    shutil.copy2(made_here, prebuilt)
    before = _files(cache)

    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), build.ENV_CACHE: str(cache)}
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_RUN], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    ran = json.loads(proc.stdout.splitlines()[-1])
    assert ran == {"level": level.name, "argmax": True, "silu_mul": True}, proc.stderr
    assert f"no C++ compiler here; loading the prebuilt {prebuilt}" in proc.stderr
    assert f"CPU kernels: ISA level {level.name}" in proc.stderr
    assert _files(cache) == before  # read only: the image's cache may be read-only


@pytest.mark.parametrize("left_there", ["nothing", "other sources", "an unfinished link"])
def test_without_a_compiler_or_a_prebuilt_build_the_torch_path_serves(
    no_compiler: Path,
    left_there: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    level = cpu_isa.chosen_level()
    library = f"{build.module_name(level)}.so"
    if left_there == "other sources":  # a build of other kernels or another torch
        (no_compiler / "0123456789abcdef" / "a-compiler").mkdir(parents=True)
        (no_compiler / "0123456789abcdef" / "a-compiler" / library).write_bytes(b"\x7fELF")
    elif left_there == "an unfinished link":  # the link rule renames its output once whole
        (no_compiler / build.source_key() / "a-compiler").mkdir(parents=True)
        (no_compiler / build.source_key() / "a-compiler" / f"{library}.tmp").write_bytes(b"")
    # uncached, so a level this process loaded before is looked up again
    monkeypatch.setattr(cpu_kernels, "_load_level", cpu_kernels._load_level.__wrapped__)
    caplog.set_level(logging.INFO, logger=cpu_kernels.log.name)

    assert cpu_kernels.load.__wrapped__() is None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("CPU kernels unavailable (no C++ compiler (")
    assert f"no prebuilt build of level {level.name} in {no_compiler / build.source_key()}" in (
        warning
    )
    assert warning.endswith("using the torch path")
