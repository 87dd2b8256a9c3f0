"""The adapter sync: every ready engine pod of an MStarDeployment holds exactly `spec.adapters`.

Why the operator and not the pod template (see adapters.py): adapters change far more often than
engine settings, and a rollout of every replica to add one fine-tune is what a platform team
cannot afford. So a periodic pass over every CR (handlers.py) compares each ready engine pod's
`/v1/models` (adapters are the entries with a `parent`, their folder in `root`, vLLM's shape)
with the desired list and calls the engine's `/v1/load_lora_adapter` / `/v1/unload_lora_adapter`
for the difference; an adapter whose folder changed is unloaded and loaded again. The same pass
serves new pods, restarted pods and live spec changes: it is level-based like `reconcile`. Where
each adapter is loaded goes to `status.adapters`; a load that fails is a Warning event (once per
new message) and the adapter's `message`, retried on the next pass.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from .adapters import desired_adapters
from .kube import Kube, KubeError
from .manifests import selector_string
from .reconcile import Event
from .spec import ENGINE_PORT, InvalidSpec, MStarSpec, parse_spec

#: Reading /v1/models; a pod that does not answer within it is skipped until the next pass.
QUERY_TIMEOUT_SECONDS = 5.0
#: Loading reads the adapter's safetensors (and may wait for a slot): give it longer.
LOAD_TIMEOUT_SECONDS = 120.0


class EngineCallFailed(Exception):
    """An engine admin call that did not answer 200: the message names the engine's reason."""


def _call(url: str, body: dict[str, Any] | None, timeout: float, key: str | None) -> Any:
    """GET (no body) or POST one engine route; ``key``: the engines' API key (bearer)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            text = resp.read().decode() or "null"
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        with contextlib.suppress(ValueError, KeyError, TypeError):
            detail = json.loads(detail)["error"]["message"]
        raise EngineCallFailed(f"{exc.code}: {detail[:300]}") from exc
    except (OSError, ValueError) as exc:  # refused, reset, timed out
        raise EngineCallFailed(str(exc)) from exc
    try:
        return json.loads(text)
    except ValueError:
        return text


def engine_url(ip: str) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{ENGINE_PORT}"


def held_adapters(url: str, key: str | None = None) -> dict[str, str | None]:
    """{adapter: its folder} an engine serves now: /v1/models' entries with a parent."""
    listing = _call(f"{url}/v1/models", None, QUERY_TIMEOUT_SECONDS, key)
    return {m["id"]: m.get("root") for m in listing.get("data", []) if m.get("parent")}


@dataclass
class PodResult:
    """One pod after one pass: what it holds, what was done, and what failed (by adapter)."""

    pod: str
    held: set[str] = field(default_factory=set)
    done: list[Event] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def sync_pod(pod: str, url: str, desired: dict[str, str], key: str | None = None) -> PodResult:
    """Bring one engine to `desired` ({name: folder}); never raises for the engine's answers.
    ``key``: the API key the engine requires (spec.apiKeySecret), sent as a bearer token."""
    out = PodResult(pod)
    try:
        held = held_adapters(url, key)
    except EngineCallFailed as exc:
        out.failed = dict.fromkeys(desired, f"{pod}: /v1/models: {exc}")
        return out
    for name, folder in held.items():
        if name in desired and folder in (None, desired[name]):
            out.held.add(name)
            continue
        try:
            _call(f"{url}/v1/unload_lora_adapter", {"lora_name": name}, LOAD_TIMEOUT_SECONDS, key)
            out.done.append(("Normal", "AdapterUnloaded", f"{name} from {pod}"))
        except EngineCallFailed as exc:
            out.failed[name] = f"{pod}: unload: {exc}"
            out.held.add(name)
    for name, folder in desired.items():
        if name in out.held or name in out.failed:
            continue
        body = {"lora_name": name, "lora_path": folder}
        try:
            _call(f"{url}/v1/load_lora_adapter", body, LOAD_TIMEOUT_SECONDS, key)
            out.held.add(name)
            out.done.append(("Normal", "AdapterLoaded", f"{name} ({folder}) on {pod}"))
        except EngineCallFailed as exc:
            out.failed[name] = f"{pod}: load {folder}: {exc}"
    return out


def ready_engine_pods(
    kube: Kube, namespace: str, name: str, spec: MStarSpec
) -> list[tuple[str, str]]:
    """(pod name, pod IP) of the engine pods that serve HTTP and are Ready, by name."""
    out = []
    for pod in kube.list_pods(namespace, selector_string(name, spec)):
        meta, status = pod["metadata"], pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        if ready and status.get("podIP") and not meta.get("deletionTimestamp"):
            out.append((meta["name"], status["podIP"]))
    return sorted(out)


def adapter_status(desired: dict[str, str], results: list[PodResult]) -> list[dict[str, Any]]:
    """status.adapters: per desired adapter, the ready pods holding it and its last failure."""
    out = []
    for name in desired:
        pods = [r.pod for r in results if name in r.held]
        entry: dict[str, Any] = {"name": name, "loaded": len(pods), "pods": pods}
        failures = [r.failed[name] for r in results if name in r.failed]
        if failures:
            entry["message"] = "; ".join(failures)[:1000]
        out.append(entry)
    return out


def sync_adapters(kube: Kube, cr: dict[str, Any]) -> list[Event]:
    """One pass for one CR (as just listed): load/unload on every ready engine pod, then write
    status.adapters. Returns the events to post. A CR without adapters, now or in its status,
    costs nothing."""
    namespace, name = cr["metadata"]["namespace"], cr["metadata"]["name"]
    if cr["metadata"].get("deletionTimestamp"):
        return []
    try:
        spec = parse_spec(cr.get("spec"))
    except InvalidSpec:
        return []  # reconcile reports it; the engines keep what they hold
    old = (cr.get("status") or {}).get("adapters")
    desired = desired_adapters(spec)
    if not desired and not old:
        return []
    secret = spec.api_key_secret
    try:
        key = None if secret is None else kube.read_secret(namespace, secret["name"], secret["key"])
    except KubeError as exc:  # on every adapter's status, retried next pass
        assert secret is not None
        message = f"spec.apiKeySecret {secret['name']}/{secret['key']}: {exc}"
        results = [PodResult("operator", failed=dict.fromkeys(desired, message))]
    else:
        results = [
            sync_pod(pod, engine_url(ip), desired, key)
            for pod, ip in ready_engine_pods(kube, namespace, name, spec)
        ]
    status = adapter_status(desired, results)
    events = [event for r in results for event in r.done]
    old_messages = {a.get("name"): a.get("message") for a in old or []}
    for entry in status:
        if entry.get("message") and entry["message"] != old_messages.get(entry["name"]):
            events.append(("Warning", "AdapterLoadFailed", f"{entry['name']}: {entry['message']}"))
    if status != old:
        kube.patch_cr_status(namespace, name, {"adapters": status})
    return events
