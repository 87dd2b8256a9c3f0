"""The kubelet's part for the engine pods of one MStarDeployment, with real engines as processes.

kwok runs no containers and no probes. For pods that carry `READY_GATE` (kwok's
`mstar-pod-engine-ready` stage in scripts/cluster.sh) this does what a node would: start the
engine on each new pod's address; mark the pod ready (`ENGINE_READY`, on which kwok writes
Ready) only once that engine answers /ready; on the pod's deletion run its preStop hook, then
SIGTERM the engine, and see it exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from built_tools import wait_until
from epp_harness import Engine, repo_env
from real_cluster import ControlPlane
from test_cluster import pods

READY_GATE = "mstar.test/ready-gate"  # scripts/cluster.sh READY_GATE
ENGINE_READY = "mstar.test/engine-ready"  # scripts/cluster.sh ENGINE_READY


def ready_gate_policy(namespace: str) -> list[dict[str, Any]]:
    """A MutatingAdmissionPolicy (GA in Kubernetes 1.36) that gates every new pod of the
    namespace on its engine's /ready: the operator's pod template stays as it renders it."""
    name = f"mstar-ready-gate-{namespace}"
    annotate = f'Object{{metadata: Object.metadata{{annotations: {{"{READY_GATE}": "engine"}}}}}}'
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": ["pods"],
                        }
                    ]
                },
                "failurePolicy": "Fail",
                "reinvocationPolicy": "Never",
                "mutations": [
                    {
                        "patchType": "ApplyConfiguration",
                        "applyConfiguration": {"expression": annotate},
                    }
                ],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {
                "policyName": name,
                "matchResources": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
                },
            },
        },
    ]


def gate_pods(cp: ControlPlane, namespace: str, timeout: float) -> None:
    """Install `ready_gate_policy` and wait until it acts (its informers lag the create): a pod
    created in the namespace (server-side dry run) comes back annotated."""
    policy = ready_gate_policy(namespace)
    cp.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                     "items": policy}))  # fmt: skip
    probe = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "ready-gate-probe", "namespace": namespace},
        "spec": {"containers": [{"name": "c", "image": "none"}]},
    }

    def gated() -> bool:
        out = cp.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                         stdin=json.dumps(probe)).stdout  # fmt: skip
        return READY_GATE in (json.loads(out)["metadata"].get("annotations") or {})

    wait_until(gated, "the ready-gate policy to act", timeout)


@dataclass
class Stopped:
    """An engine whose pod was deleted: what its preStop hook said and how it exited."""

    name: str
    prestop: str
    exit_code: int | None
    seconds: float  # from the deletion seen to the exit


@dataclass
class EngineKubelet:
    """Polls the CR's pods every 0.5 s (a thread) while entered; stops every engine on exit."""

    cp: ControlPlane
    name: str  # the MStarDeployment
    namespace: str
    model_dir: Path
    logs: Path
    engines: dict[str, Engine] = field(default_factory=dict)  # by pod name
    stopped: list[Stopped] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._pods: dict[str, dict[str, Any]] = {}
        self._marked: set[str] = set()
        self._stopping: dict[str, threading.Thread] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EngineKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        for t in list(self._stopping.values()):
            t.join(60)
        for engine in self.engines.values():
            engine.stop()

    def name_of(self, endpoint: str) -> str:
        """The pod whose engine listens at ``endpoint`` (the newest, where an IP was reused)."""
        ip = endpoint.rsplit(":", 1)[0]
        names = [n for n, e in list(self.engines.items()) if e.ip == ip]
        return names[-1] if names else f"? {endpoint}"

    def serving(self) -> list[str]:
        return [n for n in list(self.engines) if n not in self._stopping]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception as exc:  # the test reads these; the loop goes on
                self.errors.append(repr(exc))
            time.sleep(0.5)

    def _sync(self) -> None:
        live = {p["metadata"]["name"]: p for p in pods(self.cp, self.name, self.namespace)}
        for name, engine in list(self.engines.items()):
            gone = name not in live or live[name]["metadata"].get("deletionTimestamp")
            if gone and name not in self._stopping:
                t = threading.Thread(target=self._terminate, args=(name, engine))
                self._stopping[name] = t
                t.start()
        for name, pod in live.items():
            meta, ip = pod["metadata"], pod.get("status", {}).get("podIP")
            if meta.get("deletionTimestamp") or READY_GATE not in (meta.get("annotations") or {}):
                continue
            if name not in self.engines:
                # An IP freed by a deleted pod may come back while its engine still drains.
                busy = any(e.ip == ip and e.alive() for e in self.engines.values())
                if ip and not busy:
                    self._pods[name] = pod
                    maps = self._config_maps(pod)
                    self.engines[name] = Engine(pod, self.model_dir, self.logs, maps)
            elif name not in self._marked and self._ready(self.engines[name]):
                self.cp.kubectl("annotate", "pod", name, "-n", self.namespace,
                                f"{ENGINE_READY}=true", "--overwrite")  # fmt: skip
                self._marked.add(name)

    def _config_maps(self, pod: dict[str, Any]) -> dict[str, dict[str, str]]:
        """{name: data} of the ConfigMaps the pod mounts, as the kubelet would read them."""
        out = {}
        for volume in pod["spec"].get("volumes") or []:
            name = (volume.get("configMap") or {}).get("name")
            found = self.cp.get("configmap", name, self.namespace) if name else None
            if found is not None:
                out[name] = dict(found.get("data") or {})
        return out

    @staticmethod
    def _ready(engine: Engine) -> bool:
        try:
            return engine.ready()
        except OSError:
            return False

    def _terminate(self, name: str, engine: Engine) -> None:
        """preStop (the pod's own hook, on the engine's address), then SIGTERM and the drain."""
        seen = time.monotonic()
        (container,) = self._pods[name]["spec"]["containers"]
        hook = container["lifecycle"]["preStop"]["exec"]["command"]
        assert hook[0] == "mstar-engine", hook
        argv = [sys.executable, "-m", "mstar.engine.cli", *hook[1:], "--host", engine.ip]
        env = {**os.environ, **repo_env()}
        hook_out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        engine.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = engine.proc.wait(120)
        except subprocess.TimeoutExpired:
            code = None
        self.stopped.append(Stopped(name, hook_out.stdout.strip(), code, time.monotonic() - seen))
