#!/usr/bin/env bash
# A local Kubernetes control plane for the operator's tests and the README walkthrough.
#
#   scripts/cluster.sh build   build the pinned binaries once into ~/.cache/mstar/k8s (Go modules)
#   scripts/cluster.sh build-tools [epp|jaeger|adapter|lws]...   build the endpoint picker, Jaeger,
#                              prometheus-adapter and the LeaderWorkerSet controller the tests run
#                              (same cache; lws also copies its CRDs and webhook manifests)
#   scripts/cluster.sh up      build if needed, then start etcd, kube-apiserver, controller-manager,
#                              scheduler and kwok (two fake nodes, one with nvidia.com/gpu) on loopback
#   scripts/cluster.sh env     print `export KUBECONFIG=...` for the running cluster
#   scripts/cluster.sh down    stop what `up` started, by pid
#   scripts/cluster.sh crds    print a directory with the InferencePool and Gateway API CRDs
#   scripts/cluster.sh restart-apiserver   stop and start kube-apiserver alone (etcd keeps state)
#
# Environment: MSTAR_CLUSTER_DIR (state, certs, logs; default ~/.cache/mstar/cluster),
# MSTAR_K8S_CACHE (binaries), MSTAR_KWOK_READY_DELAY_MS (a pod's not-Ready spell, default 5000),
# MSTAR_HPA_DOWNSCALE_WINDOW (the HPA's scale-down stabilization, default 15s, not 5m),
# GOMODCACHE / GOCACHE (default under ~/.cache/mstar/go), MSTAR_BUILD_NICE (default 10).
#
# Why from source: no container runtime or registry serves kind/k3s here, and the Go module proxy
# serves every component at a pinned version. Everything listens on 127.0.0.0/8 only.
set -euo pipefail

ETCD_VERSION=v3.7.3
K8S_VERSION=v1.37.2
KWOK_VERSION=v0.8.0
GIE_VERSION=v1.5.0          # Gateway API Inference Extension: the InferencePool CRDs
GATEWAY_API_VERSION=v1.5.0  # Gateway API: HTTPRoute and friends
# The programs around mstar that its tests run for real (built by `build-tools`):
EPP_VERSION="$GIE_VERSION"  # the Inference Extension's endpoint picker, cmd/epp of the same module
JAEGER_VERSION=v1.75.0      # newer tags are not served at this module path
ADAPTER_VERSION=v0.12.0     # prometheus-adapter; v0.13.0 and @latest are refused by the proxy
LWS_VERSION=v0.9.0          # LeaderWorkerSet (multi-node replicas); served by exact version only

CACHE="${MSTAR_K8S_CACHE:-$HOME/.cache/mstar/k8s}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export GOMODCACHE="${GOMODCACHE:-$HOME/.cache/mstar/go/mod}"
export GOCACHE="${GOCACHE:-$HOME/.cache/mstar/go/build}"
export GOFLAGS="${GOFLAGS:--buildvcs=false} -trimpath"
export CGO_ENABLED=0
NICE="nice -n ${MSTAR_BUILD_NICE:-10}"

log() { echo "cluster.sh: $*" >&2; }
die() { echo "cluster.sh: ERROR: $*" >&2; exit 1; }

# A throwaway main module under $1 that requires $2@$3 (the module whose command we build).
new_module() {
    command -v go >/dev/null || die "go is not installed (https://go.dev/dl/, 1.26 or newer)"
    rm -rf "$1" && mkdir -p "$1"
    (cd "$1" && go mod init mstar.local/build >/dev/null 2>&1)
}

build_etcd() {
    local out="$CACHE/etcd-$ETCD_VERSION" src
    [ -x "$out/bin/etcd" ] && return 0
    log "building etcd $ETCD_VERSION (cold: ~1 min on 2 cores)"
    src="$out/src"
    new_module "$src"
    cat >"$src/main.go" <<'EOF'
// Command etcd runs the etcd server of the required go.etcd.io/etcd/server/v3 release.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
EOF
    (cd "$src" && go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" && go mod tidy \
        && $NICE go build -o "$out/bin/etcd" .)
}

build_kubernetes() {
    local out="$CACHE/kubernetes-$K8S_VERSION" src gomod staging minor ldflags cmds c
    if [ -x "$out/bin/kube-apiserver" ] && [ -x "$out/bin/kube-controller-manager" ] \
        && [ -x "$out/bin/kube-scheduler" ]; then
        return 0
    fi
    log "building kube-apiserver, kube-controller-manager, kube-scheduler $K8S_VERSION (cold: ~12 min)"
    src="$out/src"
    new_module "$src"
    # k8s.io/kubernetes replaces its staging modules with ./staging/src/...; point each at the
    # published release of the same minor (v0.37.x for v1.37.x).
    gomod="$(cd "$src" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
    staging="v0.${K8S_VERSION#v1.}"
    sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$gomod" | while read -r c; do
        (cd "$src" && go mod edit -replace "$c=$c@$staging")
    done
    cmds="k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager"
    cmds="$cmds k8s.io/kubernetes/cmd/kube-scheduler"
    for c in $cmds; do
        (cd "$src" && go get -tool "$c@$K8S_VERSION")
    done
    # Without these the binaries report v0.0.0-master and helm refuses the chart's kubeVersion.
    minor="${K8S_VERSION#v1.}"
    minor="${minor%%.*}"
    ldflags="-s -w"
    for kv in "gitVersion=$K8S_VERSION" gitMajor=1 "gitMinor=$minor" gitTreeState=clean \
        "gitCommit=$K8S_VERSION" "buildDate=1970-01-01T00:00:00Z"; do
        ldflags="$ldflags -X k8s.io/component-base/version.$kv"
    done
    mkdir -p "$out/bin"
    # shellcheck disable=SC2086  # $cmds is a list of packages
    (cd "$src" && $NICE go build -ldflags "$ldflags" -o "$out/bin/" $cmds)
}

build_kwok() {
    local out="$CACHE/kwok-$KWOK_VERSION" src dir
    [ -x "$out/bin/kwok" ] && [ -d "$out/stages" ] && return 0
    log "building kwok $KWOK_VERSION (cold: ~3 min)"
    src="$out/src"
    new_module "$src"
    (cd "$src" && go get -tool "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" \
        && $NICE go build -ldflags "-s -w" -o "$out/bin/kwok" sigs.k8s.io/kwok/cmd/kwok)
    # kwok exits "no stages found" without a stage config; its module ships the upstream ones.
    dir="$(cd "$src" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
    rm -rf "$out/stages" && cp -r "$dir/kustomize/stage" "$out/stages" && chmod -R u+w "$out/stages"
}

# The cache folder of each tool `build-tools` builds (its binaries in bin/).
tool_dir() {
    case "$1" in
        epp) echo "$CACHE/epp-$EPP_VERSION" ;;
        jaeger) echo "$CACHE/jaeger-$JAEGER_VERSION" ;;
        adapter) echo "$CACHE/prometheus-adapter-$ADAPTER_VERSION" ;;
        lws) echo "$CACHE/lws-$LWS_VERSION" ;;
        *) die "no tool $1 (epp, jaeger, adapter, lws)" ;;
    esac
}

# $1 tool, $2 module@version, $3 package of the command, $4 ldflags: `go get -tool` in a
# throwaway module, then build bin/$1. (`go install X@v` is refused for modules whose go.mod
# has replace directives, as the EPP's does.)
build_tool() {
    local out src
    out="$(tool_dir "$1")"
    [ -x "$out/bin/$1" ] && return 0
    log "building $1 ($2)"
    src="$out/src"
    new_module "$src"
    (cd "$src" && go get -tool "$3@${2#*@}" \
        && $NICE go build -ldflags "-s -w $4" -o "$out/bin/$1" "$3")
}

build_epp() {
    local out gw="$ROOT/tests/operator/extproc_gateway/main.go"
    out="$(tool_dir epp)"
    build_tool epp "sigs.k8s.io/gateway-api-inference-extension@$EPP_VERSION" \
        sigs.k8s.io/gateway-api-inference-extension/cmd/epp \
        "-X sigs.k8s.io/gateway-api-inference-extension/version.BuildRef=$EPP_VERSION"
    # The tests' gateway side of ext-proc, built against the picker's own envoy and grpc modules.
    if ! cmp -s "$gw" "$out/src/extproc_gateway/main.go" || [ ! -x "$out/bin/extproc-gateway" ]; then
        mkdir -p "$out/src/extproc_gateway" && cp "$gw" "$out/src/extproc_gateway/main.go"
        (cd "$out/src" && go mod tidy && $NICE go build -ldflags "-s -w" \
            -o "$out/bin/extproc-gateway" ./extproc_gateway)
    fi
}

build_jaeger() {
    build_tool jaeger "github.com/jaegertracing/jaeger@$JAEGER_VERSION" \
        github.com/jaegertracing/jaeger/cmd/jaeger ""
}

build_adapter() {
    build_tool adapter "sigs.k8s.io/prometheus-adapter@$ADAPTER_VERSION" \
        sigs.k8s.io/prometheus-adapter/cmd/adapter ""
}

# The LeaderWorkerSet controller (cmd of sigs.k8s.io/lws), plus what its module ships for an
# install: the CRDs (config/crd/bases) and the webhook configurations (config/webhook) in config/.
build_lws() {
    local out dir
    out="$(tool_dir lws)"
    build_tool lws "sigs.k8s.io/lws@$LWS_VERSION" sigs.k8s.io/lws/cmd \
        "-X sigs.k8s.io/lws/pkg/version.GitVersion=$LWS_VERSION"
    [ -f "$out/config/.complete" ] && return 0
    dir="$(cd "$out/src" && go list -m -f '{{.Dir}}' sigs.k8s.io/lws)"
    rm -rf "$out/config" && mkdir -p "$out/config"
    cp -r "$dir/config/crd/bases" "$out/config/crds"
    cp -r "$dir/config/webhook" "$out/config/webhook"
    chmod -R u+w "$out/config" && touch "$out/config/.complete"
}

# Print a directory with the InferencePool and Gateway API CRDs (from their Go modules).
cmd_crds() {
    local out="$CACHE/crds-gie-$GIE_VERSION-gateway-$GATEWAY_API_VERSION" gie gw
    if [ ! -f "$out/.complete" ]; then
        gie="$(module_dir "sigs.k8s.io/gateway-api-inference-extension@$GIE_VERSION")"
        gw="$(module_dir "sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION")"
        rm -rf "$out" && mkdir -p "$out"
        cp "$gie"/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml \
            "$gw"/config/crd/standard/gateway.networking.k8s.io_{gateways,gatewayclasses,httproutes}.yaml \
            "$out/"
        chmod u+w "$out"/*.yaml
        touch "$out/.complete"
    fi
    echo "$out"
}

module_dir() {
    local tmp
    tmp="$(mktemp -d)"
    (cd "$tmp" && go mod download -json "$1") \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])'
    rmdir "$tmp"
}

cmd_build() {
    local t0=$SECONDS t part
    for part in etcd kubernetes kwok; do
        t=$SECONDS
        "build_$part"
        log "$part: $((SECONDS - t)) s"
    done
    log "binaries ready in $CACHE ($((SECONDS - t0)) s)"
}

# The endpoint picker, Jaeger, prometheus-adapter and LWS (or the ones named: epp jaeger adapter
# lws); prints NAME=BIN_FOLDER for each.
cmd_build_tools() {
    local t part parts=("$@")
    [ $# -gt 0 ] || parts=(epp jaeger adapter lws)
    for part in "${parts[@]}"; do
        tool_dir "$part" >/dev/null
        t=$SECONDS
        "build_$part"
        log "$part: $((SECONDS - t)) s"
        echo "$part=$(tool_dir "$part")/bin"
    done
}


STATE="${MSTAR_CLUSTER_DIR:-$HOME/.cache/mstar/cluster}"
KWOK_READY_DELAY_MS="${MSTAR_KWOK_READY_DELAY_MS:-5000}" # a pod's not-ready spell after start
# How long the HPA keeps a higher recommendation before scaling down (Kubernetes' default: 5m).
HPA_DOWNSCALE_WINDOW="${MSTAR_HPA_DOWNSCALE_WINDOW:-15s}"
KUBE_BIN="$CACHE/kubernetes-$K8S_VERSION/bin"

# Free loopback ports, one per argument, written as NAME=port lines.
free_ports() {
    python3 -c '
import socket, sys
socks = []
for name in sys.argv[1:]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
    print(f"{name}={s.getsockname()[1]}")
' "$@"
}

# $1 name, $2 subject, $3 CA name, $4 extra extensions: a key and a cert signed by that CA.
make_cert() {
    local pki="$STATE/pki" ext
    ext="$(mktemp)"
    printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=digitalSignature,keyEncipherment" "$4" >"$ext"
    openssl req -new -newkey rsa:2048 -nodes -keyout "$pki/$1.key" -subj "$2" \
        -out "$pki/$1.csr" 2>/dev/null
    openssl x509 -req -in "$pki/$1.csr" -CA "$pki/$3.crt" -CAkey "$pki/$3.key" -CAcreateserial \
        -days 365 -extfile "$ext" -out "$pki/$1.crt" 2>/dev/null
    rm -f "$ext" "$pki/$1.csr"
}

make_pki() {
    local pki="$STATE/pki" ca san
    mkdir -p "$pki"
    for ca in ca front-proxy-ca; do
        openssl req -x509 -new -newkey rsa:2048 -nodes -days 365 -subj "/CN=mstar-local-$ca" \
            -keyout "$pki/$ca.key" -out "$pki/$ca.crt" 2>/dev/null
    done
    san="subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes"
    san="$san,DNS:kubernetes.default,DNS:kubernetes.default.svc"
    make_cert apiserver "/CN=kube-apiserver" ca "extendedKeyUsage=serverAuth
$san"
    make_cert admin "/O=system:masters/CN=mstar-admin" ca "extendedKeyUsage=clientAuth"
    make_cert controller-manager "/CN=system:kube-controller-manager" ca "extendedKeyUsage=clientAuth"
    make_cert scheduler "/CN=system:kube-scheduler" ca "extendedKeyUsage=clientAuth"
    make_cert kwok "/O=system:masters/CN=kwok" ca "extendedKeyUsage=clientAuth"
    # The apiserver's client identity towards aggregated APIs (custom.metrics.k8s.io, ...).
    make_cert front-proxy-client "/CN=front-proxy-client" front-proxy-ca "extendedKeyUsage=clientAuth"
    openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
}

# $1 user (a cert name in pki/), $2 output path.
make_kubeconfig() {
    local pki="$STATE/pki"
    cat >"$2" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: mstar-local
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    certificate-authority: $pki/ca.crt
users:
- name: $1
  user:
    client-certificate: $pki/$1.crt
    client-key: $pki/$1.key
contexts:
- name: mstar-local
  context: {cluster: mstar-local, user: $1, namespace: default}
current-context: mstar-local
EOF
}

# $1 name, then the command: started in the background, its pid in $STATE/pids/$1.
start() {
    local name="$1"
    shift
    "$@" >>"$STATE/logs/$name.log" 2>&1 &
    echo $! >"$STATE/pids/$name"
}

# $1 what, then a command that succeeds once it is ready.
wait_until() {
    local what="$1" deadline=$((SECONDS + ${MSTAR_CLUSTER_TIMEOUT:-120}))
    shift
    until "$@" >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "timed out waiting for $what; logs in $STATE/logs"
            cmd_down
            exit 1
        fi
        sleep 0.2
    done
}

running() { [ -f "$STATE/pids/$1" ] && kill -0 "$(cat "$STATE/pids/$1")" 2>/dev/null; }

# Our pod lifecycle for kwok: scheduled -> Running but not Ready (the engine loading its model)
# -> Ready after $KWOK_READY_DELAY_MS; a deleted pod goes after 1 s. On kwok's fast stages a pod
# is Ready the instant it exists, so no PDB or rollout test on such nodes would mean anything.
# A pod annotated $READY_GATE at its creation is Ready only on its engine's word instead: once
# it also carries $ENGINE_READY="true", which a test sets when the real engine on the pod's
# address answers /ready (what the kubelet's readiness probe would see).
READY_GATE=mstar.test/ready-gate
ENGINE_READY=mstar.test/engine-ready
write_pod_stages() {
    local ready_status='
      {{ $now := Now }}
      conditions:
      - {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
      containerStatuses:
      {{ range .status.containerStatuses }}
      - name: {{ .name | Quote }}
        image: {{ .image | Quote }}
        ready: true
        started: true
        restartCount: 0
        state: {running: {startedAt: {{ .state.running.startedAt | Quote }}}}
      {{ end }}'
    cat >"$STATE/pod-stages.yaml" <<EOF
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: mstar-pod-start
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: DoesNotExist}
    - {key: .status.podIP, operator: DoesNotExist}
  delay: {durationMilliseconds: 300}
  next:
    event: {type: Normal, reason: Started, message: "Started container (kwok)"}
    statusTemplate: |
      {{ \$now := Now }}
      conditions:
      - {type: PodScheduled, status: "True", lastTransitionTime: {{ \$now | Quote }}}
      - {type: Initialized, status: "True", lastTransitionTime: {{ \$now | Quote }}}
      - {type: ContainersReady, status: "False", reason: ContainersNotReady, lastTransitionTime: {{ \$now | Quote }}}
      - {type: Ready, status: "False", reason: ContainersNotReady, lastTransitionTime: {{ \$now | Quote }}}
      containerStatuses:
      {{ range .spec.containers }}
      - name: {{ .name | Quote }}
        image: {{ .image | Quote }}
        ready: false
        started: true
        restartCount: 0
        state: {running: {startedAt: {{ \$now | Quote }}}}
      {{ end }}
      hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
      podIP: {{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}
      phase: Running
      startTime: {{ \$now | Quote }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: mstar-pod-ready
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: DoesNotExist}
    - {key: .status.phase, operator: In, values: [Running]}
    - {key: '.status.conditions.[] | select( .type == "Ready" ) | .status', operator: In, values: ["False"]}
    - {key: '.metadata.annotations["$READY_GATE"]', operator: DoesNotExist}
  delay: {durationMilliseconds: $KWOK_READY_DELAY_MS}
  next:
    event: {type: Normal, reason: Ready, message: "Readiness probe passed (kwok)"}
    statusTemplate: |$ready_status
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: mstar-pod-engine-ready
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: DoesNotExist}
    - {key: .status.phase, operator: In, values: [Running]}
    - {key: '.status.conditions.[] | select( .type == "Ready" ) | .status', operator: In, values: ["False"]}
    - {key: '.metadata.annotations["$READY_GATE"]', operator: Exists}
    - {key: '.metadata.annotations["$ENGINE_READY"]', operator: In, values: ["true"]}
  next:
    event: {type: Normal, reason: Ready, message: "Readiness probe passed (its engine answered /ready)"}
    statusTemplate: |$ready_status
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: mstar-pod-delete
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: Exists}
    - {key: .metadata.finalizers, operator: DoesNotExist}
  delay: {durationMilliseconds: 1000}
  next: {delete: true}
EOF
}

# Two fake nodes: a CPU node and a GPU node (8 x nvidia.com/gpu, tainted like a real one).
write_nodes() {
    cat >"$STATE/nodes.yaml" <<'EOF'
apiVersion: v1
kind: Node
metadata:
  name: kwok-cpu-0
  annotations: {kwok.x-k8s.io/node: fake}
  labels: {type: kwok, kubernetes.io/hostname: kwok-cpu-0, kubernetes.io/os: linux}
status:
  capacity: {cpu: "16", memory: 64Gi, pods: "110"}
  allocatable: {cpu: "16", memory: 64Gi, pods: "110"}
---
apiVersion: v1
kind: Node
metadata:
  name: kwok-gpu-0
  annotations: {kwok.x-k8s.io/node: fake}
  labels:
    type: kwok
    kubernetes.io/hostname: kwok-gpu-0
    kubernetes.io/os: linux
    nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3
spec:
  taints: [{key: nvidia.com/gpu, value: present, effect: NoSchedule}]
status:
  capacity: {cpu: "64", memory: 512Gi, pods: "110", nvidia.com/gpu: "8"}
  allocatable: {cpu: "64", memory: 512Gi, pods: "110", nvidia.com/gpu: "8"}
EOF
}

apiserver_ready() {
    curl -sf --cacert "$STATE/pki/ca.crt" --cert "$STATE/pki/admin.crt" \
        --key "$STATE/pki/admin.key" "https://127.0.0.1:$APISERVER_PORT/readyz"
}

kc() { kubectl --kubeconfig "$STATE/kubeconfig" "$@"; }

nodes_ready() {
    [ "$(kc get nodes -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' \
        | grep -c True)" -ge 2 ]
}

cmd_up() {
    local t0 pki node_stages who
    if running apiserver; then
        log "already running (scripts/cluster.sh down first)"
        cmd_env
        return 0
    fi
    command -v openssl >/dev/null || die "openssl is not installed"
    command -v curl >/dev/null || die "curl is not installed"
    command -v kubectl >/dev/null || die "kubectl is not installed (scripts/install-test-tools.sh)"
    cmd_build
    t0=$SECONDS
    rm -rf "$STATE" && mkdir -p "$STATE/logs" "$STATE/pids"
    free_ports ETCD_PORT ETCD_PEER_PORT APISERVER_PORT KCM_PORT SCHEDULER_PORT >"$STATE/ports"
    # shellcheck disable=SC1091
    . "$STATE/ports"
    make_pki
    pki="$STATE/pki"
    for who in admin controller-manager scheduler kwok; do
        make_kubeconfig "$who" "$STATE/$who.kubeconfig"
    done
    mv "$STATE/admin.kubeconfig" "$STATE/kubeconfig"

    start etcd "$CACHE/etcd-$ETCD_VERSION/bin/etcd" --name=mstar --data-dir="$STATE/etcd" \
        --listen-client-urls="http://127.0.0.1:$ETCD_PORT" \
        --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-cluster="mstar=http://127.0.0.1:$ETCD_PEER_PORT" \
        --unsafe-no-fsync --log-level=warn
    wait_until etcd curl -sf "http://127.0.0.1:$ETCD_PORT/health"
    start_apiserver
    wait_until kube-apiserver apiserver_ready
    log "kube-apiserver ready $((SECONDS - t0)) s after start"

    start controller-manager "$KUBE_BIN/kube-controller-manager" \
        --kubeconfig="$STATE/controller-manager.kubeconfig" \
        --authentication-kubeconfig="$STATE/controller-manager.kubeconfig" \
        --authorization-kubeconfig="$STATE/controller-manager.kubeconfig" \
        --bind-address=127.0.0.1 --secure-port="$KCM_PORT" --leader-elect=false \
        --use-service-account-credentials=true \
        --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
        --controllers='*' --horizontal-pod-autoscaler-sync-period=5s \
        --horizontal-pod-autoscaler-downscale-stabilization="$HPA_DOWNSCALE_WINDOW"
    start scheduler "$KUBE_BIN/kube-scheduler" \
        --kubeconfig="$STATE/scheduler.kubeconfig" \
        --authentication-kubeconfig="$STATE/scheduler.kubeconfig" \
        --authorization-kubeconfig="$STATE/scheduler.kubeconfig" \
        --bind-address=127.0.0.1 --secure-port="$SCHEDULER_PORT" --leader-elect=false
    write_pod_stages
    node_stages="$CACHE/kwok-$KWOK_VERSION/stages/node"
    start kwok "$CACHE/kwok-$KWOK_VERSION/bin/kwok" --kubeconfig="$STATE/kwok.kubeconfig" \
        --config="$node_stages/fast/node-initialize.yaml" \
        --config="$node_stages/heartbeat-with-lease/node-heartbeat-with-lease.yaml" \
        --config="$STATE/pod-stages.yaml" \
        --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
        --node-lease-duration-seconds=40 --cidr=127.1.0.1/24 --node-ip=127.0.0.1
    write_nodes
    wait_until "the nodes to be created" kc apply -f "$STATE/nodes.yaml"
    wait_until "the kwok nodes to be Ready" nodes_ready
    wait_until "the default ServiceAccount" kc get serviceaccount default -n default
    log "control plane up in $((SECONDS - t0)) s; logs in $STATE/logs"
    cmd_env
}

# Aggregated APIs (custom.metrics.k8s.io) are reached at their Service's endpoints: no kube-proxy
# routes ClusterIPs here. The front-proxy flags give them the caller's identity.
start_apiserver() {
    local pki="$STATE/pki"
    start apiserver "$KUBE_BIN/kube-apiserver" \
        --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
        --bind-address=127.0.0.1 --secure-port="$APISERVER_PORT" --advertise-address=127.0.0.1 \
        --endpoint-reconciler-type=none --service-cluster-ip-range=10.96.0.0/16 \
        --enable-aggregator-routing=true \
        --authorization-mode=Node,RBAC --allow-privileged=true \
        --client-ca-file="$pki/ca.crt" \
        --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
        --service-account-issuer=https://kubernetes.default.svc.cluster.local \
        --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
        --requestheader-client-ca-file="$pki/front-proxy-ca.crt" \
        --requestheader-allowed-names=front-proxy-client \
        --requestheader-username-headers=X-Remote-User \
        --requestheader-group-headers=X-Remote-Group \
        --requestheader-extra-headers-prefix=X-Remote-Extra- \
        --proxy-client-cert-file="$pki/front-proxy-client.crt" \
        --proxy-client-key-file="$pki/front-proxy-client.key"
}

# Stop and start the apiserver alone (etcd keeps the state), as a control-plane upgrade does.
cmd_restart_apiserver() {
    running apiserver || die "not running (scripts/cluster.sh up)"
    # shellcheck disable=SC1091
    . "$STATE/ports"
    stop_one apiserver
    start_apiserver
    wait_until kube-apiserver apiserver_ready
}

# SIGTERM the process in $STATE/pids/$1, SIGKILL it after 5 s.
stop_one() {
    local pid
    [ -f "$STATE/pids/$1" ] || return 0
    pid="$(cat "$STATE/pids/$1")"
    if kill "$pid" 2>/dev/null; then
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$STATE/pids/$1"
}

cmd_down() {
    local name
    for name in kwok scheduler controller-manager apiserver etcd; do
        stop_one "$name"
    done
    log "stopped (the state stays in $STATE until the next up)"
}

cmd_env() {
    [ -f "$STATE/kubeconfig" ] || die "no cluster in $STATE (scripts/cluster.sh up)"
    echo "export KUBECONFIG=$STATE/kubeconfig"
}

case "${1:-}" in
    build) cmd_build ;;
    build-tools) shift; cmd_build_tools "$@" ;;
    crds) cmd_crds ;;
    up) cmd_up ;;
    down) cmd_down ;;
    env) cmd_env ;;
    restart-apiserver) cmd_restart_apiserver ;;
    -h | --help) sed -n '2,/^$/s/^# \{0,1\}//p' "$0" ;;  # the header above
    *) die "usage: $0 build|up|down|env|crds|restart-apiserver (--help for more)" ;;
esac
