"""Builds the C++ CPU kernels (``csrc/``) once per ISA level, into a cache every process shares.

Each level's library links the level-independent bindings (``BINDINGS``: tensor checks and
the Python module, compiled once for the x86-64 baseline, since torch's headers take about a
minute) with that level's kernel objects (the other ``csrc/*.cpp``, compiled with the level's
``-march`` in seconds: they include no tensor headers). Separate libraries, not one with every
level inside, because inline functions from shared headers would otherwise be merged across
levels by the linker, and an AVX-512 copy could then run on an AVX2 CPU.

A build lives in ``<cache root>/<source key>/<compiler key>/``: the source key hashes what the
libraries' code and ABI depend on (the sources, the flags, torch, Python's headers), the compiler
key the compiler that made them, and neither the build machine's CPU, so a cache or an image
built on one machine is reused on any other that has the same build. Where a compiler runs, a
process uses (and makes) its own compiler's build; where none does (the engine image), it loads
any complete build of the same source key (`prebuilt_library`). A library appears only once
linked whole, so its presence means a complete build. Concurrent builders (a server and its
tests) wait on one lock; ninja rebuilds only what changed.

``python -m mstar.kernels.build`` builds ahead of time (``--all`` for every level, as the image
does); the engine builds the level it runs on first use.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import logging
import os
import shlex
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

from mstar.kernels import cpu_isa

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
#: compiled into every level; bindings.cpp is compiled once and linked into each
KERNEL_SOURCES = (
    "attention.cpp",
    "attention_prefill.cpp",
    "glue.cpp",
    "sampling.cpp",
    "gemm_amx.cpp",
    "gemm_dpbf16.cpp",
    "gemm_fma.cpp",
    "level.cpp",
    "quant_gemm.cpp",
    "moe.cpp",
    "lora.cpp",
)
#: the tensor side, compiled once and linked into every level (torch's headers are slow)
BINDINGS = (
    "bindings.cpp",
    "gemm_bindings.cpp",
    "decode_bindings.cpp",
    "moe_bindings.cpp",
    "moe_decode.cpp",
    "lora_bindings.cpp",
    "huge_pages.cpp",
)
#: the prefix of each level's library and Python module name (`module_name`)
MODULE = "mstar_cpu_kernels"
#: overrides the cache's location (default: $XDG_CACHE_HOME or ~/.cache, then mstar/kernels)
ENV_CACHE = "MSTAR_KERNELS_CACHE"

_COMMON = ("-fPIC", "-std=c++20", "-fopenmp")
_KERNEL_FLAGS = ("-O3", "-fvisibility=hidden")


def _torch_flags() -> list[str]:
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    return ["-DTORCH_API_INCLUDE_EXTENSION_H"] + [
        arg for path in includes for arg in ("-isystem", path)
    ]


def _link_flags() -> list[str]:
    from torch.utils import cpp_extension

    lib = cpp_extension.library_paths()[0]
    return ["-shared", "-fopenmp", f"-L{lib}", "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]


class NoCompiler(RuntimeError):
    """No C++ compiler runs here: only a prebuilt build can be loaded (`prebuilt_library`)."""


@functools.cache
def _compiler() -> tuple[str, str]:
    """(the C++ compiler, its version line): what the compiler key hashes."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise NoCompiler(f"no C++ compiler ({cxx}): {exc}") from exc
    return cxx, out.stdout.splitlines()[0]


def source_key() -> str:
    """Sources, flags, torch and Python's headers: builds with equal keys run the same code
    against the same ABI, whichever compiler made them."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for level in cpu_isa.levels():  # what the compiler sees; not `requires` (a set, unordered)
        digest.update(repr((level.name, level.cflags)).encode())
    digest.update(repr((_COMMON, _KERNEL_FLAGS, torch.__version__)).encode())
    digest.update(sysconfig.get_paths()["include"].encode())
    return digest.hexdigest()[:16]


def compiler_key() -> str:
    """The compiler's command and version line; raises `NoCompiler` where none runs."""
    return hashlib.sha256(repr(_compiler()).encode()).hexdigest()[:8]


def cache_root() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "mstar" / "kernels"


def build_dir() -> Path:
    """Where this machine's compiler builds (raises `NoCompiler` where none runs)."""
    return cache_root() / source_key() / compiler_key()


def module_name(level: cpu_isa.Level) -> str:
    """The Python module a level's library defines (a distinct one per level)."""
    return f"{MODULE}_{level.name.replace('-', '_')}"


def library_path(level: cpu_isa.Level) -> Path:
    return build_dir() / f"{module_name(level)}.so"


def prebuilt_library(level: cpu_isa.Level) -> Path | None:
    """A complete build of this level from these sources and torch, by any compiler (for a
    machine without one, such as the engine image); None when the cache holds none. Never
    writes: the cache may be read-only."""
    found = sorted((cache_root() / source_key()).glob(f"*/{module_name(level)}.so"))
    return found[0] if found else None


def _ninja_file(levels: list[cpu_isa.Level]) -> str:
    cxx, _ = _compiler()
    q = shlex.join
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {shlex.quote(cxx)}",
        f"torch_flags = {q([*_COMMON, *_torch_flags()])}",
        f"ldflags = {q(_link_flags())}",
        "rule cxx",
        "  command = $cxx -MMD -MF $out.d $torch_flags $flags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = CXX $out",
        "rule link",  # linked aside, then renamed: a library present is a complete one
        "  command = $cxx $in $ldflags -o $out.tmp && mv -f $out.tmp $out",
        "  description = LINK $out",
    ]
    for source in BINDINGS:
        lines += [f"build {Path(source).stem}.o: cxx {q([str(CSRC / source)])}", "  flags = -O2"]
    bindings = " ".join(f"{Path(source).stem}.o" for source in BINDINGS)
    for level in levels:
        objects = []
        for source in KERNEL_SOURCES:
            obj = f"{level.name}/{Path(source).stem}.o"
            objects.append(obj)
            lines.append(f"build {obj}: cxx {q([str(CSRC / source)])}")
            defines = [
                f'-DMSTAR_ISA_LEVEL="{level.name}"',
                f'-DMSTAR_MODULE="{module_name(level)}"',
                f"-DMSTAR_PYINIT=PyInit_{module_name(level)}",
            ]
            lines.append(f"  flags = {q([*_KERNEL_FLAGS, *level.cflags, *defines])}")
        lines.append(f"build {library_path(level).name}: link {bindings} {' '.join(objects)}")
    return "\n".join(lines) + "\n"


def build(levels: list[cpu_isa.Level]) -> float:
    """Builds (or finds up to date) these levels' libraries; returns the seconds it took.

    Raises RuntimeError with the compiler's output on failure: a build that fails is an error
    for the caller to report, never a silent fallback.
    """
    start = time.monotonic()
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all(library_path(lvl).exists() for lvl in levels):
            return time.monotonic() - start
        (directory / "build.ninja").write_text(_ninja_file(levels))
        targets = [library_path(lvl).name for lvl in levels]
        jobs = str(max(1, os.cpu_count() or 1))
        proc = subprocess.run(
            [_ninja(), "-C", str(directory), "-j", jobs, *targets],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr)[-4000:]
            raise RuntimeError(f"building the CPU kernels failed in {directory}:\n{tail}")
    return time.monotonic() - start


def _ninja() -> str:
    """The ninja of the ``ninja`` package (a dependency), else one on PATH."""
    try:
        import ninja

        return str(Path(ninja.BIN_DIR) / "ninja")
    except (ImportError, AttributeError):
        return "ninja"


def main(argv: list[str] | None = None) -> int:
    """``python -m mstar.kernels.build``: build the kernels ahead of first use."""
    parser = argparse.ArgumentParser(
        prog="python -m mstar.kernels.build",
        description="Build mstar's C++ CPU kernels into the shared cache "
        f"({cache_root()}; {ENV_CACHE} moves it).",
    )
    parser.add_argument(
        "--all", action="store_true", help="every ISA level of this architecture (for images)"
    )
    parser.add_argument(
        "--level",
        action="append",
        default=[],
        help="a level to build (repeatable; default: the one this CPU runs, "
        f"or {cpu_isa.ENV_LEVEL}'s)",
    )
    args = parser.parse_args(argv)
    if args.all:
        chosen = list(cpu_isa.levels())
    elif args.level:
        chosen = [cpu_isa.resolve(name) for name in args.level]
    else:
        chosen = [cpu_isa.chosen_level()]
    seconds = build(chosen)
    for level in chosen:
        print(f"{level.name}: {library_path(level)}")
    print(f"built in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
