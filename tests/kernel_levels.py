"""One ISA level's C++ kernels for the tests that compare levels (built on first use)."""

from __future__ import annotations

from typing import Any

from external_tools import require_tool

from mstar.kernels import cpu_isa, cpu_kernels


def level_kernels(level: str) -> Any:
    """The extension of ``level`` (a `cpu_isa` level name this CPU runs), checked to be it."""
    require_tool("g++")
    require_tool("ninja")
    ext = cpu_kernels.load_level(cpu_isa.resolve(level))
    assert ext.isa_level() == level
    return ext
