"""An `MStarDeployment` spec, defaulted and checked, and its engine flags.

The API server applies the CRD's schema defaults, but the operator fills the same defaults itself
so that it behaves the same against an older CRD or a server that skipped them (tests check the
two sets agree). Checks the schema cannot express (relations between fields) live here: a spec
that fails them becomes a `Degraded` condition, never an exception escaping a handler.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mstar.engine.config import EngineConfig

GROUP = "mstar.dev"
VERSION = "v1alpha1"
PLURAL = "mstardeployments"
KIND = "MStarDeployment"
API_VERSION = f"{GROUP}/{VERSION}"

ENGINE_PORT = 8000  # inside the pod; the Service maps spec.service.port onto it
MODEL_MOUNT = "/models"
#: Where the engine ConfigMap is mounted in an engine pod.
CONFIG_MOUNT = "/etc/mstar"
#: The ConfigMap key holding the adapter list (`adapters.py`); not hashed into the pod template.
ADAPTERS_KEY = "adapters.json"
#: Where the ranks of a multi-node replica meet: torch.distributed's store on the leader pod.
DIST_PORT = 29500
#: What the LeaderWorkerSet controller's pod webhook puts in every container's environment
#: (sigs.k8s.io/lws api/leaderworkerset/v1): the leader's DNS name, this pod's index in its
#: group (0: the leader); the kubelet expands `$(NAME)` in container args from it.
LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"

# Same values as the CRD's `default:` keywords (tests/operator/test_crd_schema.py compares).
DEFAULTS: dict[str, Any] = {
    "image": "ghcr.io/mstar-project/mstar-engine:0.1.0",
    "imagePullPolicy": "IfNotPresent",
    "replicas": 1,
    "resources": {
        "gpus": 1,
        "gpuResourceName": "nvidia.com/gpu",
        "cpu": "4",
        "memory": "32Gi",
        "shmSize": "2Gi",
    },
    "engine": {
        "pageSize": 16,
        "maxNumSeqs": 64,
        "maxNumBatchedTokens": 2048,
        "stepBudget": "adaptive",
        "attentionBackend": "auto",
        "cudaGraphBatchSizes": [1, 2, 4, 8, 16, 32, 64],
        "enforceEager": False,
        "enablePreplan": True,
        "evictionPolicy": "lru",
        "hostOffloadGiB": 1,
        "enablePrefixCaching": True,
        "dtype": "auto",
        "maxWaitingRequests": 256,
        "shutdownGraceSeconds": 30,
        "seed": 0,
        "deterministic": False,
    },
    "telemetry": {"samplingRatio": 1, "metrics": True},
    "service": {"type": "ClusterIP", "port": 8000},
    "drain": {"quietSeconds": 5, "preStopTimeoutSeconds": 30},
    "scheduling": {},
    "parallelism": {"tensorParallelSize": 1, "nodesPerReplica": 1},
}
AUTOSCALING_DEFAULTS: dict[str, Any] = {
    "mode": "hpa",
    "minReplicas": 1,
    "targetWaitingRequestsPerReplica": 4,
    "metricName": "mstar_num_requests_waiting",
    "keda": {"pollingIntervalSeconds": 15, "cooldownSeconds": 300},
}
EPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0"
ROUTER_DEFAULTS: dict[str, Any] = {
    "path": "/",
    "requestTimeout": "300s",
    "endpointPicker": {
        "image": EPP_IMAGE,
        "failureMode": "FailOpen",
        "cpu": "1",
        "memory": "1Gi",
        "weights": {"queue": 2, "kvCache": 2, "prefixCache": 3, "loraAffinity": 4},
    },
}
SOURCE_DEFAULTS: dict[str, dict[str, Any]] = {
    "pvc": {"subPath": ""},
    "huggingFace": {"revision": "main", "cacheSize": "20Gi"},
}
TOKEN_SECRET_DEFAULTS: dict[str, Any] = {"key": "token"}
#: spec.apiKeySecret: the Secret key holding the engines' API key (`MSTAR_API_KEY`)
API_KEY_SECRET_DEFAULTS: dict[str, Any] = {"key": "api-key"}
#: An adapter's sources: a path in the pod, a PVC, or a Hugging Face repository (adapters.py).
ADAPTER_SOURCE_DEFAULTS: dict[str, dict[str, Any]] = {
    "pvc": {"subPath": ""},
    "huggingFace": {"revision": "main"},
}

# CRD engine keys -> EngineConfig fields (the one flag contract with `mstar-engine serve`).
ENGINE_FIELDS: dict[str, str] = {
    "numPages": "num_pages",
    "gpuMemoryUtilization": "gpu_memory_utilization",
    "pageSize": "page_size",
    "maxNumSeqs": "max_num_seqs",
    "maxNumBatchedTokens": "max_num_batched_tokens",
    "stepBudget": "step_budget",
    "maxModelLen": "max_model_len",
    "attentionBackend": "attention_backend",
    "cudaGraphBatchSizes": "cuda_graph_batch_sizes",
    "enforceEager": "enforce_eager",
    "enablePreplan": "enable_preplan",
    "evictionPolicy": "eviction_policy",
    "hostOffloadGiB": "host_offload_gb",
    "enablePrefixCaching": "enable_prefix_caching",
    "dtype": "dtype",
    "maxWaitingRequests": "max_waiting_requests",
    "shutdownGraceSeconds": "shutdown_grace_seconds",
    "seed": "seed",
    "deterministic": "deterministic",
    "maxLoras": "max_loras",
    "maxLoraRank": "max_lora_rank",
}

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|K|M|G|T)?$")
_UNITS = {
    None: 1,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


class InvalidSpec(ValueError):
    """The spec cannot be served as written; `problems` name each field at fault."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def _merge_defaults(value: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(value))
    for key, default in defaults.items():
        if key not in out or out[key] is None:
            out[key] = copy.deepcopy(default)
        elif isinstance(default, Mapping) and isinstance(out[key], Mapping):
            out[key] = _merge_defaults(out[key], default)
    return out


def quantity_bytes(text: str) -> float:
    """A memory quantity ("32Gi", "500M") in bytes; ValueError when malformed."""
    match = _QUANTITY.match(str(text))
    if not match:
        raise ValueError(f"not a memory quantity: {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass(frozen=True)
class MStarSpec:
    """A defaulted spec (CRD field names kept, so messages match what the user wrote)."""

    raw: dict[str, Any]

    @property
    def model(self) -> dict[str, Any]:
        return dict(self.raw["model"])

    @property
    def source(self) -> dict[str, Any]:
        return dict(self.raw["model"].get("source") or {})

    @property
    def engine(self) -> dict[str, Any]:
        return dict(self.raw["engine"])

    @property
    def autoscaling(self) -> dict[str, Any] | None:
        value = self.raw.get("autoscaling")
        return dict(value) if value else None

    @property
    def nodes_per_replica(self) -> int:
        """Pods of one replica: above 1 the replica is a LeaderWorkerSet group."""
        return int(self.raw["parallelism"]["nodesPerReplica"])

    @property
    def adapters(self) -> list[dict[str, Any]]:
        """spec.adapters, defaulted: each {name, source: one of path, pvc, huggingFace}."""
        return [dict(a) for a in self.raw.get("adapters") or []]

    @property
    def serves_lora(self) -> bool:
        """The engines serve LoRA adapters: some are listed, or slots are sized for them."""
        return bool(self.adapters) or "maxLoras" in self.raw["engine"]

    @property
    def api_key_secret(self) -> dict[str, str] | None:
        """spec.apiKeySecret ({name, key}): the engines require its value as a bearer token on
        /v1/*, and the operator's adapter sync sends it; None: no key."""
        value = self.raw.get("apiKeySecret")
        return dict(value) if value else None

    @property
    def router(self) -> dict[str, Any] | None:
        value = self.raw.get("router")
        return dict(value) if value else None

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]


def parse_spec(spec: Mapping[str, Any] | None) -> MStarSpec:
    """Default `spec` and check what the schema cannot; raises InvalidSpec listing every problem."""
    if not isinstance(spec, Mapping):
        raise InvalidSpec(["spec: missing"])
    raw = _merge_defaults(spec, DEFAULTS)
    problems: list[str] = []
    model = raw.get("model")
    if not isinstance(model, Mapping) or not model.get("name"):
        problems.append("spec.model.name: required")
        model = {}
    source = dict(model.get("source") or {})
    if len(source) > 1:
        problems.append(
            f"spec.model.source: set exactly one of path, pvc, huggingFace (got {sorted(source)})"
        )
    _default_source(source, SOURCE_DEFAULTS)
    if model:
        raw["model"] = {**model, "source": source} if source else dict(model)
    raw["adapters"], adapter_problems = _parse_adapters(raw.get("adapters"), raw)
    if isinstance(raw.get("apiKeySecret"), Mapping):
        raw["apiKeySecret"] = _merge_defaults(raw["apiKeySecret"], API_KEY_SECRET_DEFAULTS)
    problems += adapter_problems
    if raw.get("autoscaling"):
        raw["autoscaling"] = _merge_defaults(raw["autoscaling"], AUTOSCALING_DEFAULTS)
        problems += _autoscaling_problems(raw["autoscaling"])
    if raw.get("router"):
        raw["router"] = _merge_defaults(raw["router"], ROUTER_DEFAULTS)
    drain = raw["drain"]
    if drain["quietSeconds"] > drain["preStopTimeoutSeconds"]:
        problems.append(
            f"spec.drain.quietSeconds ({drain['quietSeconds']}) exceeds preStopTimeoutSeconds "
            f"({drain['preStopTimeoutSeconds']}): the preStop hook could never see the pod quiet"
        )
    engine = raw["engine"]
    if "numPages" in engine and "gpuMemoryUtilization" in engine:
        problems.append("spec.engine: set numPages or gpuMemoryUtilization, not both")
    if "numPages" in engine and "maxModelLen" in engine:
        capacity = engine["numPages"] * engine["pageSize"]
        if capacity < engine["maxModelLen"]:
            problems.append(
                f"spec.engine.maxModelLen ({engine['maxModelLen']}) exceeds the KV capacity "
                f"numPages*pageSize = {capacity} tokens: one request could never be admitted"
            )
    resources = raw["resources"]
    problems += _layout_problems(raw["parallelism"], int(resources["gpus"]))
    try:
        memory = quantity_bytes(resources["memory"])
        offload = float(engine["hostOffloadGiB"]) * 2**30
        if offload >= memory:
            problems.append(
                f"spec.engine.hostOffloadGiB ({engine['hostOffloadGiB']} GiB) does not fit in "
                f"spec.resources.memory ({resources['memory']})"
            )
    except ValueError as exc:
        problems.append(f"spec.resources.memory: {exc}")
    if not problems:
        try:
            engine_config(MStarSpec(raw))
        except (TypeError, ValueError) as exc:
            problems.append(f"spec.engine: {exc}")
    if problems:
        raise InvalidSpec(problems)
    return MStarSpec(raw)


def _default_source(source: dict[str, Any], defaults: Mapping[str, Any]) -> None:
    """Fill a model's or an adapter's source (in place) with its kind's defaults."""
    for kind, values in defaults.items():
        if isinstance(source.get(kind), Mapping):
            source[kind] = _merge_defaults(source[kind], values)
    hf = source.get("huggingFace")
    if isinstance(hf, dict) and isinstance(hf.get("tokenSecret"), Mapping):
        hf["tokenSecret"] = _merge_defaults(hf["tokenSecret"], TOKEN_SECRET_DEFAULTS)


def _parse_adapters(value: Any, raw: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """spec.adapters with source defaults, and what the schema cannot say (unique names, none
    named like the base model, one source each)."""
    if not value:
        return [], []
    base = (raw.get("model") or {}).get("name")
    out: list[dict[str, Any]] = []
    problems: list[str] = []
    seen: set[str] = set()
    for i, item in enumerate(value):
        where = f"spec.adapters[{i}]"
        name = str(item.get("name") or "")
        source = dict(item.get("source") or {})
        if not name:
            problems.append(f"{where}.name: required")
        elif name in seen:
            problems.append(f"{where}.name: {name!r} is listed twice")
        elif name == base:
            problems.append(f"{where}.name: {name!r} is the base model's name (spec.model.name)")
        seen.add(name)
        if len(source) != 1:
            problems.append(
                f"{where}.source: set exactly one of path, pvc, huggingFace (got {sorted(source)})"
            )
        _default_source(source, ADAPTER_SOURCE_DEFAULTS)
        out.append({**item, "name": name, "source": source})
    return out, problems


def _layout_problems(parallel: dict[str, Any], gpus: int) -> list[str]:
    """One rank per GPU: the pods of a replica hold exactly tensorParallelSize GPUs (on CPU,
    gpus 0, each pod runs the same number of ranks)."""
    tp, nodes = int(parallel["tensorParallelSize"]), int(parallel["nodesPerReplica"])
    if gpus > 0 and gpus * nodes != tp:
        return [
            f"spec.parallelism: resources.gpus ({gpus}) x nodesPerReplica ({nodes}) = "
            f"{gpus * nodes} GPUs per replica, but tensorParallelSize is {tp} (one rank per GPU)"
        ]
    if gpus == 0 and tp % nodes:
        return [
            f"spec.parallelism: tensorParallelSize ({tp}) is not a multiple of nodesPerReplica "
            f"({nodes}): every pod of a replica runs the same number of ranks"
        ]
    return []


def _autoscaling_problems(auto: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    if "maxReplicas" not in auto:
        problems.append("spec.autoscaling.maxReplicas: required")
    elif auto["minReplicas"] > auto["maxReplicas"]:
        problems.append(
            f"spec.autoscaling: minReplicas ({auto['minReplicas']}) exceeds "
            f"maxReplicas ({auto['maxReplicas']})"
        )
    if auto["mode"] == "hpa" and auto["minReplicas"] < 1:
        problems.append(
            "spec.autoscaling.minReplicas: 0 (scale to zero) needs mode: keda; an HPA keeps >= 1"
        )
    if auto["mode"] == "keda" and not auto["keda"].get("prometheusAddress"):
        problems.append(
            "spec.autoscaling.keda.prometheusAddress: required with mode: keda "
            "(the Prometheus that scrapes the engine pods)"
        )
    return problems


def model_path(spec: MStarSpec) -> str | None:
    """The checkpoint folder the engine is given, as seen inside the pod."""
    source = spec.source
    if "path" in source:
        return str(source["path"])
    if "pvc" in source:
        sub = str(source["pvc"].get("subPath") or "").strip("/")
        return f"{MODEL_MOUNT}/{sub}" if sub else MODEL_MOUNT
    if "huggingFace" in source:
        return f"{MODEL_MOUNT}/hf"
    return None


def engine_config(spec: MStarSpec) -> EngineConfig:
    """The engine's settings for this spec; rendered with `to_cli_args` into the container."""
    values: dict[str, Any] = {
        ENGINE_FIELDS[key]: value for key, value in spec.engine.items() if key in ENGINE_FIELDS
    }
    if "cuda_graph_batch_sizes" in values:
        values["cuda_graph_batch_sizes"] = list(values["cuda_graph_batch_sizes"])
    for name in ("host_offload_gb", "gpu_memory_utilization", "shutdown_grace_seconds"):
        if name in values:
            values[name] = float(values[name])
    gpus = int(spec["resources"]["gpus"])
    nodes = spec.nodes_per_replica
    return EngineConfig(
        model=model_path(spec),
        served_model_name=str(spec.model["name"]),
        host="0.0.0.0",
        port=ENGINE_PORT,
        device="cuda" if gpus > 0 else "cpu",
        tensor_parallel_size=int(spec["parallelism"]["tensorParallelSize"]),
        nnodes=nodes,
        # The same for every pod of a group; the pod's own rank is added per pod (lws.py).
        dist_init_addr=f"$({LWS_LEADER_ADDRESS}):{DIST_PORT}" if nodes > 1 else None,
        # The adapter list is no flag (adapters.py): a new pod reads it from the mounted
        # ConfigMap at start, and the adapter sync hot-loads changes into running pods.
        enable_lora=spec.serves_lora,
        lora_modules_file=f"{CONFIG_MOUNT}/{ADAPTERS_KEY}" if spec.serves_lora else None,
        **values,
    )
