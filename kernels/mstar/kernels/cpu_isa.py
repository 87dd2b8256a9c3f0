"""The CPU's instruction-set level: which build of the C++ kernels it can run, and which it runs.

The kernels are compiled once per level (`LEVELS`, lowest first) rather than with
``-march=native``, so one build (a wheel, an image, a shared cache) runs on every x86-64 node:
the loader picks the highest level whose features the CPU reports, or the one
``MSTAR_CPU_ISA`` names (a lower level, to compare or to test the AVX2 code on an AVX-512
machine). The levels follow the x86-64 psABI's microarchitecture levels where they exist:
``x86-64`` (SSE2, a plain fallback), ``x86-64-v3`` (AVX2, FMA, F16C), ``x86-64-v4`` (AVX-512
F/BW/CD/DQ/VL), then AVX512-BF16 and AMX on top. Other architectures get one ``generic`` build.

`CpuFeatures` is a value, so the GEMM selection and these choices can be tested with any CPU's
features substituted for the machine's.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

#: Names a level for the loader instead of the best the CPU runs (e.g. ``x86-64-v3``).
ENV_LEVEL = "MSTAR_CPU_ISA"


@dataclass(frozen=True)
class Level:
    """One build of the kernels: its compiler flags and the CPU flags it needs to run."""

    name: str
    cflags: tuple[str, ...]
    requires: frozenset[str]
    summary: str


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
#: SIMD flags no level requires that still change a kernel choice (oneDNN's bf16 check)
_EXTRA_ISA_FLAGS = frozenset({"avx_ne_convert", "avx512_fp16", "amx_int8", "amx_fp16"})
_V4_FLAGS = ("-march=x86-64-v4", "-mtune=generic", "-mprefer-vector-width=512")

X86_LEVELS = (
    Level("x86-64", ("-march=x86-64", "-mtune=generic"), frozenset(), "SSE2 baseline"),
    Level("x86-64-v3", ("-march=x86-64-v3", "-mtune=generic"), _V3, "AVX2, FMA, F16C"),
    Level("x86-64-v4", _V4_FLAGS, _V4, "AVX-512"),
    Level(
        "avx512-bf16",
        (*_V4_FLAGS, "-mavx512bf16"),
        _V4 | {"avx512_bf16"},
        "AVX-512 with AVX512-BF16 (VDPBF16PS)",
    ),
    Level(
        "amx",
        (*_V4_FLAGS, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
        _V4 | {"avx512_bf16", "amx_tile", "amx_bf16"},
        "AVX-512 with AVX512-BF16 and AMX bf16 tiles",
    ),
)
GENERIC_LEVELS = (Level("generic", (), frozenset(), "the compiler's default target"),)

#: short names users type for a level
ALIASES = {"avx2": "x86-64-v3", "avx512": "x86-64-v4", "sse2": "x86-64", "baseline": "x86-64"}


def levels() -> tuple[Level, ...]:
    """This architecture's levels, lowest first."""
    return X86_LEVELS if platform.machine() in ("x86_64", "AMD64") else GENERIC_LEVELS


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's feature flags as Linux's /proc/cpuinfo spells them (``avx2``, ``avx512_bf16``)."""

    flags: frozenset[str]
    vendor: str = ""

    def runs(self, level: Level) -> bool:
        return level.requires <= self.flags

    def missing(self, level: Level) -> list[str]:
        return sorted(level.requires - self.flags)

    @property
    def onednn_bf16(self) -> bool:
        """oneDNN has a bf16 GEMM here (torch's check: AVX512 BW/VL/DQ, or AVX-NE-CONVERT)."""
        return {"avx512bw", "avx512vl", "avx512dq"} <= self.flags or "avx_ne_convert" in self.flags

    @property
    def bf16_math(self) -> bool:
        """Native bf16 dot products (AVX512-BF16 or AMX); elsewhere bf16 GEMMs widen to float32."""
        return "avx512_bf16" in self.flags or {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def intel(self) -> bool:
        return self.vendor == "GenuineIntel"


@functools.cache
def detect() -> CpuFeatures:
    """This machine's features and vendor (the first processor's); none known off Linux."""
    flags: str | None = None
    vendor: str | None = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "flags" and flags is None:
                    flags = value
                elif key == "vendor_id" and vendor is None:
                    vendor = value.strip()
                if flags is not None and vendor is not None:
                    break
    except OSError:
        pass
    return CpuFeatures(frozenset((flags or "").split()), vendor or "")


def best_level(features: CpuFeatures) -> Level:
    """The highest level these features run."""
    return [lvl for lvl in levels() if features.runs(lvl)][-1]


def resolve(name: str) -> Level:
    """The level a user named (or an alias); ValueError naming the choices otherwise."""
    wanted = ALIASES.get(name.strip().lower(), name.strip().lower())
    for lvl in levels():
        if lvl.name == wanted:
            return lvl
    choices = ", ".join(lvl.name for lvl in levels())
    raise ValueError(f"{ENV_LEVEL}={name!r} names no ISA level here (one of: {choices})")


def chosen_level(features: CpuFeatures | None = None) -> Level:
    """The level the loader runs: ``MSTAR_CPU_ISA`` if set (refused when the CPU lacks its
    features: it would die of an illegal instruction), else `best_level`."""
    features = features or detect()
    named = os.environ.get(ENV_LEVEL, "").strip()
    if not named:
        return best_level(features)
    level = resolve(named)
    if not features.runs(level):
        raise ValueError(
            f"{ENV_LEVEL}={named!r}: this CPU lacks {', '.join(features.missing(level))}"
        )
    return level


def planning_features() -> CpuFeatures:
    """The features mstar plans its GEMMs for: the CPU's, capped at ``MSTAR_CPU_ISA``'s level
    when one is named, so a forced ``x86-64-v3`` runs as on an AVX2 CPU (no oneDNN bf16, no
    VDPBF16PS), not as AVX2 kernels beside AVX-512 GEMMs."""
    features = detect()
    if not os.environ.get(ENV_LEVEL, "").strip():
        return features
    level = chosen_level(features)
    above = frozenset().union(*(lvl.requires for lvl in levels())) | _EXTRA_ISA_FLAGS
    return CpuFeatures(features.flags - (above - level.requires), features.vendor)


def supported_levels(features: CpuFeatures | None = None) -> list[Level]:
    """Every level this CPU runs, lowest first (what the kernel tests compare): with
    ``MSTAR_CPU_ISA`` set, those up to it, so a forced ``x86-64-v3`` tests as an AVX2 CPU would
    (oneDNN capped alike would refuse the higher levels' bf16 GEMMs)."""
    features = features or planning_features()
    return [lvl for lvl in levels() if features.runs(lvl)]
