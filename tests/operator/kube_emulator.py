"""A KMock Kubernetes emulator that behaves enough like kube-apiserver for an operator test.

KMock stores and streams objects; this subclass adds what a real control plane would do and the
operator relies on: uid / resourceVersion / generation / creationTimestamp, names from
`generateName`, CRDs that register their resource (discovery, status and scale subresources),
schema defaulting and validation of custom resources (422 on violation, as the API server does),
status-subresource semantics, 404 for resources nobody registered, the scale subresource of
custom resources (what `kubectl scale` and an HPA call), and owner-reference garbage collection
(background cascading delete, as kube-controller-manager's garbage collector does).

`EmulatedCluster` runs it on a loopback port in a background thread and writes a kubeconfig, so
`kubectl` and an operator subprocess talk to it like to any cluster.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import json
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import aiohttp.web
import attrs
import kmock
import yaml
from crd_schema import apply_defaults, problems
from kmock._internal import enums
from kmock._internal.dicts import patch_dict

T = TypeVar("T")

BUILTINS: dict[str, kmock.ResourceInfo] = {
    "v1/configmaps": kmock.ResourceInfo(kind="ConfigMap", namespaced=True, shortnames={"cm"}),
    "v1/services": kmock.ResourceInfo(
        kind="Service", namespaced=True, shortnames={"svc"}, subresources={"status"}
    ),
    "v1/events": kmock.ResourceInfo(kind="Event", namespaced=True, shortnames={"ev"}),
    "v1/secrets": kmock.ResourceInfo(kind="Secret", namespaced=True),
    "v1/serviceaccounts": kmock.ResourceInfo(
        kind="ServiceAccount", namespaced=True, shortnames={"sa"}
    ),
    "policy/v1/poddisruptionbudgets": kmock.ResourceInfo(
        kind="PodDisruptionBudget", namespaced=True, shortnames={"pdb"}, subresources={"status"}
    ),
    "rbac.authorization.k8s.io/v1/rolebindings": kmock.ResourceInfo(
        kind="RoleBinding", namespaced=True
    ),
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", namespaced=False, shortnames={"ns"}),
    "apps/v1/deployments": kmock.ResourceInfo(
        kind="Deployment",
        namespaced=True,
        shortnames={"deploy"},
        subresources={"status", "scale"},
    ),
    "autoscaling/v2/horizontalpodautoscalers": kmock.ResourceInfo(
        kind="HorizontalPodAutoscaler",
        namespaced=True,
        shortnames={"hpa"},
        subresources={"status"},
    ),
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, shortnames={"crd", "crds"}
    ),
}
VERBS = {"create", "delete", "get", "list", "patch", "update", "watch", "deletecollection"}


def _merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch turning `old` into exactly `new` (removed keys become None)."""
    out: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(old.get(key), dict):
            sub = _merge_patch(old[key], value)
            if sub:
                out[key] = sub
        elif old.get(key) != value or key not in old:
            out[key] = value
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class ClusterEmulator(kmock.KubernetesEmulator):
    """KubernetesEmulator + the control-plane behaviours listed in the module docstring."""

    _versions: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    _schemas: dict[kmock.resource, dict[str, Any]] = attrs.field(factory=dict, init=False)
    _status_subresource: set[kmock.resource] = attrs.field(factory=set, init=False)
    _scale_paths: dict[kmock.resource, dict[str, str]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, info in BUILTINS.items():
            info.verbs = set(VERBS)
            info.singular = (info.kind or "").lower()
            self.resources[key] = info
        self.objects["v1/namespaces", None, "default"] = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": "default", "uid": str(uuid.uuid4())},
        }

    # -- request pre-processing: what kube-apiserver does before storing ----------------------

    def _key(self, request: kmock.Request, name: str | None) -> Any:
        return (request.resource, request.namespace, name)

    def _stored(self, request: kmock.Request, name: str | None) -> dict[str, Any] | None:
        key = self._key(request, name)
        if key in self.objects and not self.objects[key].deleted:
            raw = self.objects[key].raw
            return copy.deepcopy(dict(raw))
        return None

    def _admit_custom(self, request: kmock.Request, obj: dict[str, Any]) -> dict[str, Any]:
        schema = self._schemas.get(request.resource)  # type: ignore[arg-type]
        if schema is None:
            return obj
        obj = apply_defaults(schema, obj)
        errors = problems(schema, obj)
        if errors:
            raise kmock.KubernetesError(
                status=422,
                reason="Invalid",
                message=f"{obj.get('kind')} {obj['metadata'].get('name')!r} is invalid: "
                + "; ".join(errors),
            )
        return obj

    def _prepare(self, request: kmock.Request) -> kmock.Request:
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            obj = copy.deepcopy(request.data)
            meta = obj.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            info = self.resources[request.resource] if request.resource else None
            if request.namespace and (info is None or info.namespaced is not False):
                meta["namespace"] = request.namespace
            meta.update(
                uid=str(uuid.uuid4()),
                resourceVersion=str(next(self._versions)),
                generation=1,
                creationTimestamp=_now(),
            )
            if request.resource in self._status_subresource:
                obj.pop("status", None)
            obj = self._admit_custom(request, obj)
            return attrs.evolve(request, data=obj)
        if request.action == enums.action.UPDATE and isinstance(request.data, (dict, list)):
            old = self._stored(request, request.name)
            if old is None:
                return request  # KMock answers 404
            patch = copy.deepcopy(request.data)
            if isinstance(patch, list):  # a JSON patch: apply it, then continue as a merge patch
                try:
                    patch = _merge_patch(old, dict(patch_dict(old, patch)))
                except Exception as exc:  # a failing "test"/"remove" op: 422 as the server does
                    raise kmock.KubernetesError(
                        status=422, reason="Invalid", message=f"JSON patch failed: {exc}"
                    ) from exc
            if request.resource in self._status_subresource:
                if request.subresource == "status":
                    patch = {"status": patch.get("status")} if "status" in patch else {}
                else:
                    patch.pop("status", None)
            new = dict(patch_dict(old, patch))
            if request.subresource != "status":
                new = self._admit_custom(request, new)  # stored defaulted, as the server does
            meta = dict(new.get("metadata") or {})
            if new.get("spec") != old.get("spec"):
                meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
            meta["resourceVersion"] = str(next(self._versions))
            new["metadata"] = meta
            patch = _merge_patch(old, new)
            return attrs.evolve(request, data=patch)
        return request

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is None:
            return await super()._handle(request)
        registered = {(r.group, r.version, r.plural) for r in self.resources}
        res = request.resource
        if res.plural and (res.group, res.version, res.plural) not in registered:
            return await self._render_error(  # KMock would store anything: the API server
                # serves only the resources that are registered (built in or by a CRD)
                kmock.KubernetesError(
                    status=404,
                    reason="NotFound",
                    message="the server could not find the requested resource",
                )
            )
        if request.subresource == "scale" and request.resource in self._scale_paths:
            return await self._serve_scale(request)
        try:
            prepared = self._prepare(request)
        except kmock.KubernetesError as exc:
            return await self._render_error(exc)
        if prepared is not request:  # KMock's reactions match requests it has recorded
            requests = self._requests
            requests[next(i for i, r in enumerate(requests) if r is request)] = prepared
            request = prepared
        name = request.name
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            name = request.data["metadata"].get("name")
        before = self._stored(request, name)
        response = await super()._handle(request)
        after = self._stored(request, name)
        created = request.action == enums.action.CREATE and after and before is None
        if created and after and after.get("kind") == "CustomResourceDefinition":
            self._register_crd(after)
        if before is not None and after is None:
            await self._collect_garbage(str(before["metadata"].get("uid")))
        elif after is not None and before is None:
            await self._collect_orphan(after)
        return response

    async def _serve_version(self, request: kmock.Request) -> Any:
        """KMock's resource list, with the core group named "v1" (not "/v1") as kubectl expects."""
        payload = await super()._serve_version(request)
        if isinstance(payload, dict) and str(payload.get("groupVersion", "")).startswith("/"):
            payload = {**payload, "groupVersion": payload["groupVersion"].lstrip("/")}
        return payload

    async def _serve_list(self, request: kmock.Request) -> Any:
        """KMock's list, plus the kind and apiVersion that kubectl insists on."""
        payload = await super()._serve_list(request)
        info = self.resources[request.resource] if request.resource else None
        resource = request.resource
        if isinstance(payload, dict) and info is not None and resource is not None:
            group_version = f"{resource.group}/{resource.version}".lstrip("/")
            payload = {
                "apiVersion": group_version,
                "kind": f"{info.kind}List",
                **payload,
                "metadata": {"resourceVersion": str(next(self._versions))},
            }
        return payload

    # -- the scale subresource of custom resources --------------------------------------------

    def _scale(self, obj: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
        """The autoscaling/v1 Scale the API server derives from the CRD's scale paths."""

        def at(path: str) -> Any:
            node: Any = obj
            for part in path.lstrip(".").split("."):
                node = node.get(part) if isinstance(node, dict) else None
            return node

        meta = obj["metadata"]
        status: dict[str, Any] = {"replicas": int(at(paths["statusReplicasPath"]) or 0)}
        if paths.get("labelSelectorPath") and at(paths["labelSelectorPath"]):
            status["selector"] = at(paths["labelSelectorPath"])
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                key: meta[key]
                for key in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if key in meta
            },
            "spec": {"replicas": int(at(paths["specReplicasPath"]) or 0)},
            "status": status,
        }

    async def _serve_scale(self, request: kmock.Request) -> Any:
        """GET reads the Scale; PATCH/PUT of it writes spec.replicas of the object itself."""
        assert request.resource is not None
        paths = self._scale_paths[request.resource]
        stored = self._stored(request, request.name)
        if stored is None:
            return await self._render_error(
                kmock.KubernetesError(status=404, reason="NotFound", message="not found")
            )
        if request.action == enums.action.UPDATE:
            scale = self._scale(stored, paths)
            change = request.data
            if isinstance(change, list):  # a JSON patch of the Scale
                change = patch_dict(scale, change)
            replicas = (dict(change or {}).get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                return await self._render_error(
                    kmock.KubernetesError(
                        status=422, reason="Invalid", message=f"spec.replicas: {replicas!r}"
                    )
                )
            field = paths["specReplicasPath"].lstrip(".").split(".")
            update: dict[str, Any] = {field[-1]: replicas}
            for part in reversed(field[:-1]):
                update = {part: update}
            # Replay it as a merge patch of the object (what the API server stores).
            as_patch = attrs.evolve(request, subresource=None, data=update)
            requests = self._requests
            requests[next(i for i, r in enumerate(requests) if r is request)] = as_patch
            response = await self._handle(as_patch)
            if response.status >= 400:
                return response
            stored = self._stored(request, request.name) or stored
        return aiohttp.web.json_response(self._scale(stored, paths))

    # -- control-plane behaviours -------------------------------------------------------------

    def _register_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            resource = kmock.resource(spec["group"], version["name"], names["plural"])
            subresources = set((version.get("subresources") or {}).keys())
            self.resources[resource] = kmock.ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular"),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                shortnames=set(names.get("shortNames") or []),
                categories=set(names.get("categories") or []),
                subresources=subresources,
                verbs=set(VERBS),
            )
            self._schemas[resource] = version["schema"]["openAPIV3Schema"]
            if "status" in subresources:
                self._status_subresource.add(resource)
            if "scale" in subresources:
                self._scale_paths[resource] = dict(version["subresources"]["scale"])

    async def _collect_orphan(self, obj: dict[str, Any]) -> None:
        """A new object whose owners are all gone is garbage at once (the GC's dangling check)."""
        refs = obj.get("metadata", {}).get("ownerReferences") or []
        if not refs:
            return
        async with self._lock:
            alive = {
                o.raw.get("metadata", {}).get("uid") for o in self.objects.values() if not o.deleted
            }
            if any(ref.get("uid") in alive for ref in refs):
                return
            for key, stored in list(self.objects.items()):
                if (
                    not stored.deleted
                    and stored.raw["metadata"].get("uid") == obj["metadata"]["uid"]
                ):
                    raw = copy.deepcopy(stored.raw)
                    stored.delete()
                    await self._buses[key[0]].put({"type": "DELETED", "object": raw})

    async def _collect_garbage(self, owner_uid: str) -> None:
        """Background cascading deletion of every object whose ownerReferences name the owner."""
        doomed: list[tuple[Any, dict[str, Any]]] = []
        async with self._lock:
            for key, obj in list(self.objects.items()):
                if obj.deleted:
                    continue
                refs = obj.raw.get("metadata", {}).get("ownerReferences") or []
                if any(ref.get("uid") == owner_uid for ref in refs):
                    raw = copy.deepcopy(obj.raw)
                    obj.delete()
                    doomed.append((key, raw))
                    await self._buses[key[0]].put({"type": "DELETED", "object": raw})
        for _key, raw in doomed:
            await self._collect_garbage(str(raw["metadata"].get("uid")))


class EmulatedCluster:
    """The emulator on 127.0.0.1:<free port> in a thread of its own, plus a kubeconfig for it."""

    def __init__(self, workdir: Path) -> None:
        self.kubeconfig = workdir / "kubeconfig"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.emulator: ClusterEmulator | None = None
        self.url = ""
        self._thread = threading.Thread(target=self._main, name="kube-emulator", daemon=True)

    def __enter__(self) -> EmulatedCluster:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the Kubernetes emulator did not start")
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "emu", "cluster": {"server": self.url}}],
                    "users": [{"name": "emu", "user": {"token": "emulated"}}],
                    "contexts": [
                        {
                            "name": "emu",
                            "context": {"cluster": "emu", "user": "emu", "namespace": "default"},
                        }
                    ],
                    "current-context": "emu",
                }
            )
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with ClusterEmulator() as emulator, kmock.Server(emulator) as server:
            self.emulator = emulator
            self.url = f"http://{server.host}:{server.port}"
            self._ready.set()
            await self._stop.wait()

    def call(self, fn: Callable[[ClusterEmulator], T]) -> T:
        """Run `fn(emulator)` on the emulator's loop (no races with requests being served)."""
        future: Future[T] = Future()

        def run() -> None:
            try:
                assert self.emulator is not None
                future.set_result(fn(self.emulator))
            except BaseException as exc:  # handed to the caller's thread
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return future.result(30)

    def objects(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Live objects of a resource ('apps/v1/deployments'), as JSON copies."""

        def read(emu: ClusterEmulator) -> list[dict[str, Any]]:
            res = kmock.resource(resource)
            return [
                json.loads(json.dumps(obj.raw))
                for (r, ns, _), obj in emu.objects.items()
                if r == res and not obj.deleted and (namespace is None or ns == namespace)
            ]

        return self.call(read)

    def get(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        for obj in self.objects(resource, namespace):
            if obj["metadata"]["name"] == name:
                return obj
        return None
