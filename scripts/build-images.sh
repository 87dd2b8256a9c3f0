#!/usr/bin/env bash
# Build mstar's container images from this repository, without pulling from any registry.
#
#   scripts/build-images.sh                  # operator + CPU engine (the default)
#   scripts/build-images.sh engine-cuda      # GPU engine (FlashInfer; needs the PyTorch and
#                                            #   FlashInfer wheel indexes, see below)
#   scripts/build-images.sh lock             # re-pin engine_pod/requirements/*.txt, operator/
#
# 1. bases: `mmdebstrap` makes a Debian bookworm rootfs with Python 3.11 (pinned package
#    versions), `podman import` turns it into localhost/mstar-base:<hash>; the engine's build
#    stage gets a second one with g++ and Python's headers too (localhost/mstar-base-build),
#    where it compiles the C++ CPU kernels, so the image itself carries no compiler.
# 2. wheels: `pip download` fetches exactly the pinned wheels (requirements files) into
#    $MSTAR_CACHE/wheels; the mstar wheel itself is built from this checkout.
# 3. images: `podman build` runs engine_pod/Dockerfile / operator/Dockerfile with those wheels
#    bind-mounted and no network; every image is labelled with a hash of all its inputs and is
#    rebuilt only when that hash changes.
#
# Images: localhost/mstar-operator:$TAG, localhost/mstar-engine-cpu:$TAG, localhost/mstar-engine:$TAG
# Environment: MSTAR_IMAGE_TAG (0.1.0), MSTAR_CACHE (~/.cache/mstar), MSTAR_PIP_ARGS (extra pip
# download args, e.g. an index), MSTAR_DEBIAN_MIRROR (http://deb.debian.org).
# podman runs with runc and a containers.conf without default ulimits (what works on hosts with
# cgroups v1/hybrid and no setrlimit; crun fails there).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
TAG="${MSTAR_IMAGE_TAG:-0.1.0}"
CACHE="${MSTAR_CACHE:-$HOME/.cache/mstar}"
WHEELS="$CACHE/wheels"
WORK="$CACHE/images"
MIRROR="${MSTAR_DEBIAN_MIRROR:-http://deb.debian.org}"
# The base's packages, pinned (bookworm with its updates and security suites).
BASE_PACKAGES="python3.11=3.11.2-6+deb12u9,python3-venv=3.11.2-1+b1,ca-certificates=20250419~deb12u2,passwd"
# The engine's build stage: the base's packages and what compiles the kernels (bookworm's GCC 12).
BUILDER_PACKAGES="$BASE_PACKAGES,g++=4:12.2.0-3,python3.11-dev=3.11.2-6+deb12u9"
# Both engine images take torch 2.13.0 from PyPI: there it is the CUDA 13.0 build, and it is
# what the CPU image runs too (PyPI has no CPU-only torch for Linux x86-64; see
# engine_pod/README.md). --isolated ignores local pip config (find-links holding a local
# torch-2.13.0+cpu wheel would otherwise satisfy torch==2.13.0). FlashInfer's precompiled
# kernels (flashinfer-jit-cache) come from FlashInfer's own index for that CUDA version.
ENGINE_PIP_ARGS="--isolated"
CUDA_PIP_ARGS="$ENGINE_PIP_ARGS --extra-index-url https://flashinfer.ai/whl/cu130"
mkdir -p "$WHEELS" "$WORK"

log() { printf 'build-images: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

podman_() {
    # CONTAINERS_CONF: our file unless the caller brought one.
    if [ -z "${CONTAINERS_CONF:-}" ]; then
        printf '[containers]\ndefault_ulimits = []\n' >"$WORK/containers.conf"
        export CONTAINERS_CONF="$WORK/containers.conf"
    fi
    podman "$@"
}

hash_of() { sha256sum | cut -c1-16; }

image_hash() { podman_ image inspect --format '{{ index .Labels "dev.mstar.inputs" }}' "$1" 2>/dev/null || true; }

source_hash() {
    # What the mstar wheel is built from (file contents only: identical in any checkout).
    tar -c --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
        --exclude=__pycache__ --exclude='*.pyc' \
        pyproject.toml README.md engine_pod/mstar kernels/mstar operator/mstar | hash_of
}

base_image() {
    # $1 repository (localhost/mstar-base, localhost/mstar-base-build), $2 its packages
    local repo="$1" packages="$2" args hash name tar
    args="bookworm minbase no-docs $packages $MIRROR"
    hash="$(printf '%s' "$args" | hash_of)"
    name="$repo:bookworm-$hash"
    if podman_ image exists "$name"; then
        echo "$name"
        return
    fi
    command -v mmdebstrap >/dev/null || die "mmdebstrap is not installed (apt-get install mmdebstrap)"
    tar="$WORK/base-$hash.tar"
    log "base: mmdebstrap bookworm ($packages)"
    # shellcheck disable=SC2016  # $1 is the rootfs, expanded by mmdebstrap's hook shell
    mmdebstrap --quiet --variant=minbase --include="$packages" \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-include=/usr/share/locale/locale.alias' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        bookworm "$tar" \
        "deb $MIRROR/debian bookworm main" \
        "deb $MIRROR/debian bookworm-updates main" \
        "deb $MIRROR/debian-security bookworm-security main" >&2
    podman_ import --change 'CMD ["/bin/bash"]' "$tar" "$name" >/dev/null
    rm -f "$tar"
    # Older bases (other inputs) go once no image is built on them any more.
    podman_ images --format '{{.Repository}}:{{.Tag}}' "$repo" | grep -vx "$name" \
        | xargs -r podman rmi >/dev/null 2>&1 || true
    echo "$name"
}

fetch_wheels() {
    # $1: extra pip args (words), then the requirements files. A stamp per input set makes a
    # second run offline and instant.
    local extra="$1" stamp platforms=() v
    shift
    stamp="$WHEELS/.done-$( { cat "$@"; printf '%s' "$extra"; } | hash_of)"
    [ -e "$stamp" ] && return
    # Every manylinux tag the base's glibc (bookworm: 2.36) runs, and the legacy aliases.
    for v in $(seq 5 36); do platforms+=(--platform "manylinux_2_${v}_x86_64"); done
    for v in manylinux1 manylinux2010 manylinux2014; do platforms+=(--platform "${v}_x86_64"); done
    log "wheels: pip download -r $*"
    for f in "$@"; do
        # shellcheck disable=SC2086  # the extra args are words
        python3 -m pip download --quiet --disable-pip-version-check --no-deps \
            --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 \
            "${platforms[@]}" --platform any $extra ${MSTAR_PIP_ARGS:-} -d "$WHEELS" -r "$f" >&2
    done
    touch "$stamp"
}

mstar_wheel() {
    local hash dir
    hash="$(source_hash)"
    dir="$WORK/mstar-wheel-$hash"
    if [ ! -d "$dir" ]; then
        log "wheel: mstar from this checkout"
        rm -rf "$WORK"/mstar-wheel-*
        python3 -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
            -w "$dir" . >&2
    fi
    echo "$dir"
}

build() {
    # $1 image, $2 Dockerfile, $3 requirements dir, $4 REQUIREMENTS build arg, $5 wheel dir,
    # $6 the build stage's base (BUILDER_IMAGE; empty for a Dockerfile without a build stage)
    local image="$1" dockerfile="$2" reqs="$3" variant="$4" wheel="$5" builder="$6" base ctx
    local inputs old build_args
    base="$(base_image localhost/mstar-base "$BASE_PACKAGES")"
    build_args=(--build-arg BASE_IMAGE="$base" --build-arg REQUIREMENTS="$variant")
    [ -z "$builder" ] || build_args+=(--build-arg BUILDER_IMAGE="$builder")
    inputs="$( { cat "$dockerfile"; tar -c --sort=name --mtime=@0 -C "$reqs" . ; \
        printf '%s %s %s %s' "$base" "$builder" "$variant" "$(basename "$wheel")"; source_hash; } \
        | hash_of)"
    if [ "$(image_hash "$image")" = "$inputs" ]; then
        log "$image is up to date"
        echo "$image"
        return
    fi
    ctx="$WORK/context-$(basename "${image%%:*}")"
    rm -rf "$ctx"
    mkdir -p "$ctx/wheels"
    cp -a "$reqs" "$ctx/requirements"
    cp -al "$WHEELS"/*.whl "$ctx/wheels/" 2>/dev/null || cp "$WHEELS"/*.whl "$ctx/wheels/"
    cp "$wheel"/*.whl "$ctx/wheels/"
    log "build: $image"
    old="$(podman_ image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)"
    podman_ build --runtime runc --network none --pull=never --layers=false \
        "${build_args[@]}" \
        --label dev.mstar.inputs="$inputs" -f "$dockerfile" -t "$image" "$ctx" >&2
    rm -rf "$ctx"
    # The image this one replaces (now untagged) would only take disk space.
    [ -z "$old" ] || podman_ rmi "$old" >/dev/null 2>&1 || true
    echo "$image"
}

lock() {
    # Re-resolve the pinned sets with pip (metadata only) and write them back.
    local tmp
    tmp="$(mktemp -d)"
    # shellcheck disable=SC2086  # the extra args are words
    python3 -m pip install --quiet $ENGINE_PIP_ARGS --dry-run --ignore-installed \
        --report "$tmp/cpu.json" "torch==2.13.0" . ${MSTAR_PIP_ARGS:-}
    # shellcheck disable=SC2086  # the extra args are words
    python3 -m pip install --quiet $ENGINE_PIP_ARGS --dry-run --ignore-installed \
        --report "$tmp/cuda.json" \
        "torch==2.13.0" "flashinfer-python==0.6.13" "flashinfer-cubin==0.6.13" .
    python3 -m pip install --quiet --dry-run --ignore-installed --report "$tmp/operator.json" \
        "kopf==1.45.2" "kubernetes==37.0.2" "pyyaml==6.0.4"
    python3 - "$tmp" <<'EOF'
import json, sys
tmp = sys.argv[1]
HEAD = ("# Every Python package of the {what}, pinned: the image is built\n"
        "# from exactly these wheels. Regenerate with `scripts/build-images.sh lock`.\n")
NOTES = {
    "cpu": ("# torch 2.13.0 from PyPI, its CUDA 13.0 build (it imports only with the nvidia-* libraries\n"
            "# present, and runs on CPU): PyPI has no CPU-only build. triton is left out: only\n"
            "# torch.compile's GPU code uses it (the engine never compiles), and it is 0.7 GB. The image\n"
            "# installs this complete set with --no-deps.\n"),
    "cuda": ("# torch 2.13.0 on PyPI is its CUDA 13.0 build, with the CUDA libraries as nvidia-* wheels\n"
             "# (no CUDA toolkit in the base). flashinfer-jit-cache (precompiled kernels: no nvcc at run\n"
             "# time) comes from FlashInfer's cu130 index, at flashinfer-python's exact version.\n"),
    "operator": "",
}
WHAT = {"cpu": "CPU engine image (REQUIREMENTS=cpu)", "cuda": "GPU engine image (REQUIREMENTS=cuda)",
        "operator": "operator image"}
# Never pinned: mstar itself (its wheel is built from the checkout) and, for cpu, triton.
DROP = {"cpu": {"mstar", "triton"}, "cuda": {"mstar"}, "operator": {"mstar"}}
OUT = {"cpu": "engine_pod/requirements/cpu.txt", "cuda": "engine_pod/requirements/cuda.txt",
       "operator": "operator/requirements.txt"}
for key, path in OUT.items():
    report = json.load(open(f"{tmp}/{key}.json"))
    pins = [f"{i['metadata']['name']}=={i['metadata']['version']}"
            for i in report["install"] if i["metadata"]["name"] not in DROP[key]]
    if key == "cuda":
        pins.append("flashinfer-jit-cache==0.6.13")
    text = HEAD.format(what=WHAT[key]) + NOTES[key] + "\n".join(sorted(pins, key=str.lower)) + "\n"
    open(path, "w").write(text)
    print(f"{path}: {len(pins)} pins")
EOF
    rm -rf "$tmp"
}

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(operator engine-cpu)
for target in "${targets[@]}"; do
    case "$target" in
        lock) lock; continue ;;
        operator|engine-cpu|engine-cuda) ;;
        *) die "unknown target $target (operator, engine-cpu, engine-cuda, lock)" ;;
    esac
    command -v podman >/dev/null || die "podman is not installed (apt-get install podman runc)"
    wheel="$(mstar_wheel)"
    case "$target" in
        operator)
            fetch_wheels "" operator/requirements.txt
            mkdir -p "$WORK/operator-requirements"
            cp operator/requirements.txt "$WORK/operator-requirements/operator.txt"
            build "localhost/mstar-operator:$TAG" operator/Dockerfile \
                "$WORK/operator-requirements" operator "$wheel" "" ;;
        engine-cpu)
            builder="$(base_image localhost/mstar-base-build "$BUILDER_PACKAGES")"
            fetch_wheels "$ENGINE_PIP_ARGS" engine_pod/requirements/cpu.txt \
                engine_pod/requirements/no-deps.txt
            build "localhost/mstar-engine-cpu:$TAG" engine_pod/Dockerfile \
                "$ROOT/engine_pod/requirements" cpu "$wheel" "$builder" ;;
        engine-cuda)
            builder="$(base_image localhost/mstar-base-build "$BUILDER_PACKAGES")"
            fetch_wheels "$CUDA_PIP_ARGS" engine_pod/requirements/cuda.txt \
                engine_pod/requirements/no-deps.txt
            build "localhost/mstar-engine:$TAG" engine_pod/Dockerfile \
                "$ROOT/engine_pod/requirements" cuda "$wheel" "$builder" ;;
    esac
done
