"""The local control plane of `scripts/cluster.sh` for the operator's end-to-end tests.

A real kube-apiserver, controller-manager and scheduler with kwok's fake nodes: what it claims is
checked by the real API machinery (schema, CEL, RBAC, garbage collector, Deployment and
disruption controllers, scheduler, eviction API). One control plane per test session; the
operator runs as a process with the token of the chart's own ServiceAccount.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SH = ROOT / "scripts" / "cluster.sh"
RELEASE = "mstar"
RELEASE_NAMESPACE = "mstar-system"
OPERATOR_SA = f"{RELEASE}-operator"  # the chart's ServiceAccount for release "mstar"


class ControlPlane:
    """`scripts/cluster.sh up` in its own state directory; `down` stops it by pid."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.env = {**os.environ, "MSTAR_CLUSTER_DIR": str(state)}
        self.kubeconfig = state / "kubeconfig"

    def _script(self, *args: str, timeout: float) -> str:
        proc = subprocess.run(
            ["bash", str(CLUSTER_SH), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            logs = "\n".join(
                f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                for p in sorted((self.state / "logs").glob("*.log"))
            )
            raise RuntimeError(
                f"cluster.sh {' '.join(args)} failed:\n{proc.stderr[-4000:]}\n{logs}"
            )
        return proc.stderr

    def up(self) -> str:
        """Start it (building the binaries first if the cache is cold); cluster.sh's log."""
        return self._script("up", timeout=3600)

    def down(self) -> None:
        self._script("down", timeout=120)

    def restart_apiserver(self) -> None:
        self._script("restart-apiserver", timeout=180)

    def server_version(self) -> str:
        return str(self.kubectl_json("version")["serverVersion"]["gitVersion"])

    def kubectl(
        self, *args: str, kubeconfig: Path | None = None, check: bool = True, stdin: str = ""
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["kubectl", f"--kubeconfig={kubeconfig or self.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {proc.stderr}")
        return proc

    def kubectl_json(self, *args: str) -> dict[str, Any]:
        out = json.loads(self.kubectl(*args, "-o", "json").stdout)
        assert isinstance(out, dict)
        return out

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        proc = self.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
        if proc.returncode != 0:
            if "NotFound" in proc.stderr:
                return None
            raise AssertionError(f"kubectl get {kind} {name} failed: {proc.stderr}")
        out = json.loads(proc.stdout)
        assert isinstance(out, dict)
        return out

    def items(self, kind: str, namespace: str, *selector: str) -> list[dict[str, Any]]:
        return list(self.kubectl_json("get", kind, "-n", namespace, *selector)["items"])

    def helm(self, *args: str) -> str:
        proc = subprocess.run(
            ["helm", f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed: {proc.stderr}")
        return proc.stdout

    def token_kubeconfig(self, service_account: str, namespace: str, path: Path) -> Path:
        """A kubeconfig that authenticates as the ServiceAccount (a TokenRequest token)."""
        token = self.kubectl(
            "create", "token", service_account, "-n", namespace, "--duration=4h"
        ).stdout.strip()
        config = json.loads(self.kubectl("config", "view", "--raw", "-o", "json").stdout)
        cluster = config["clusters"][0]["cluster"]
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "local", "cluster": cluster}],
                    "users": [{"name": service_account, "user": {"token": token}}],
                    "contexts": [
                        {"name": "local", "context": {"cluster": "local", "user": service_account}}
                    ],
                    "current-context": "local",
                }
            )
        )
        path.chmod(0o600)
        return path
