"""LoRA adapters of an MStarDeployment (`spec.adapters`): where each one is inside an engine pod,
and what the pod needs to hold them.

The adapter list is deliberately NOT in the engine pod template (no `--lora-modules` flag, nothing
in the config hash): a change of `spec.adapters` alone must not roll the Deployment. The operator
writes the list into the engine ConfigMap (`adapters.json`, in vLLM's `--lora-modules` JSON form,
left out of the hash); the template carries only `--lora-modules-file /etc/mstar/adapters.json`,
so a new pod serves (and loads) the list it finds at start before it reports Ready. The adapter
sync (`adapter_sync.py`) then loads and unloads adapters on every ready engine pod through the
engine's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, so running pods converge too.

What the pod template does carry is what a path needs to exist: a PVC other than the model's gets
a read-only volume at `/adapters/pvc/<claim>`, and a Hugging Face adapter is downloaded by an init
container into an emptyDir at `/adapters/hf/<name>` (the engine itself never downloads). So
adding an adapter on a path already in the pod (the image, the model's PVC, an adapter PVC already
mounted) hot-loads; one that needs a new volume or download changes the template and rolls.
"""

from __future__ import annotations

from typing import Any

from .spec import MODEL_MOUNT, MStarSpec

ADAPTER_MOUNT = "/adapters"
HF_ADAPTER_VOLUME = "adapters-hf"


def _pvc_mount(claim: str) -> str:
    return f"{ADAPTER_MOUNT}/pvc/{claim}"


def _extra_claims(spec: MStarSpec) -> list[str]:
    """PVCs holding adapters other than the model's own, sorted (each one a pod volume)."""
    model_claim = (spec.source.get("pvc") or {}).get("claimName")
    claims = {a["source"]["pvc"]["claimName"] for a in spec.adapters if "pvc" in a["source"]}
    return sorted(claims - {model_claim})


def adapter_path(spec: MStarSpec, adapter: dict[str, Any]) -> str:
    """The adapter's folder as the engine pod sees it."""
    source = adapter["source"]
    if "path" in source:
        return str(source["path"])
    if "pvc" in source:
        pvc = source["pvc"]
        on_model_volume = pvc["claimName"] == (spec.source.get("pvc") or {}).get("claimName")
        root = MODEL_MOUNT if on_model_volume else _pvc_mount(pvc["claimName"])
        sub = str(pvc.get("subPath") or "").strip("/")
        return f"{root}/{sub}" if sub else root
    return f"{ADAPTER_MOUNT}/hf/{adapter['name']}"


def desired_adapters(spec: MStarSpec) -> dict[str, str]:
    """{adapter name: path in the pod}, in spec order: what every ready engine should hold."""
    return {a["name"]: adapter_path(spec, a) for a in spec.adapters}


def adapter_modules(spec: MStarSpec) -> list[dict[str, str]]:
    """The ConfigMap's adapter list, as the engine's ``--lora-modules-file`` reads it."""
    return [{"name": name, "path": path} for name, path in desired_adapters(spec).items()]


def adapter_volumes(spec: MStarSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, engine volume mounts) for the adapters' PVCs and Hugging Face downloads."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for i, claim in enumerate(_extra_claims(spec)):
        name = f"adapters-pvc-{i}"
        volumes.append(
            {"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        )
        mounts.append({"name": name, "mountPath": _pvc_mount(claim), "readOnly": True})
    if hf_adapters(spec):
        volumes.append({"name": HF_ADAPTER_VOLUME, "emptyDir": {}})
        mounts.append(
            {"name": HF_ADAPTER_VOLUME, "mountPath": f"{ADAPTER_MOUNT}/hf", "readOnly": True}
        )
    return volumes, mounts


def hf_adapters(spec: MStarSpec) -> list[tuple[dict[str, Any], str]]:
    """(huggingFace source, download folder) of each adapter fetched at pod start."""
    return [
        (a["source"]["huggingFace"], adapter_path(spec, a))
        for a in spec.adapters
        if "huggingFace" in a["source"]
    ]
