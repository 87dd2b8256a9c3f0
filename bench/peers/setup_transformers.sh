#!/usr/bin/env bash
# transformers in its own virtual environment (never the project's). Idempotent.
# Prints the venv's python. torch==2.13.0: PyPI's (its CUDA 13.0 build, which runs on CPU), or a
# local CPU wheel where pip's find-links holds one.
set -euo pipefail
VENV="${MSTAR_BENCH_VENVS:-$HOME/.cache/mstar/bench-venvs}/transformers"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import transformers" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        torch==2.13.0 transformers==5.24.0 safetensors >&2
fi
echo "$VENV/bin/python"
