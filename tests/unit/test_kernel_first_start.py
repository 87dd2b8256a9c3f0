"""A first start compiles the CPU kernels: the log says so before the compiler runs, not after."""

import logging

import pytest

from mstar.kernels import build, cpu_isa, cpu_kernels


def test_the_first_build_is_announced_before_it_runs(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(build.ENV_CACHE, str(tmp_path))
    seen_before_build: list[str] = []

    def compile_nothing(levels: list[cpu_isa.Level]) -> float:
        seen_before_build.extend(r.getMessage() for r in caplog.records)
        raise RuntimeError("stop here")

    monkeypatch.setattr(build, "build", compile_nothing)
    caplog.set_level(logging.INFO, logger=cpu_kernels.log.name)
    with pytest.raises(RuntimeError, match="stop here"):
        cpu_kernels._load_level.__wrapped__(cpu_isa.levels()[0].name)
    assert any("building level" in m and "first start" in m for m in seen_before_build)


def test_a_built_level_loads_without_the_announcement(caplog):
    level = cpu_isa.chosen_level()
    build.build([level])  # the suite's cache: already built by any earlier kernel test
    caplog.set_level(logging.INFO, logger=cpu_kernels.log.name)
    cpu_kernels._load_level.__wrapped__(level.name)
    assert not any("building level" in r.getMessage() for r in caplog.records)
