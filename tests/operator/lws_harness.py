"""The real LeaderWorkerSet controller (sigs.k8s.io/lws, built by `scripts/cluster.sh
build-tools lws`) on the local control plane, installed from what its module ships.

Its CRDs come from the module's config/crd/bases, its webhook configurations from
config/webhook (with the module's own patches: the pod webhooks see only LWS pods). The
webhooks are reached by URL on loopback with a CA this harness makes (no Service can route to
a loopback address); LWS's internal certificate rotation, which writes a Secret and patches a
webhook Service, is off. The pod webhook matters: it labels the group's pods and injects the
LWS_* environment the engine's rank flags are expanded from.
"""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from built_tools import Process, free_port, tool_bin, wait_until
from real_cluster import ControlPlane

#: The module's patches of its two webhook configurations (kustomize targets them by kind).
WEBHOOK_PATCHES = {
    "MutatingWebhookConfiguration": "mutating-patch.yaml",
    "ValidatingWebhookConfiguration": "validating-patch.yaml",
}
LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_serving_cert(folder: Path) -> bytes:
    """A CA and a certificate for 127.0.0.1 signed by it (tls.crt / tls.key, as LWS reads
    them); the CA in PEM for the webhook configurations' caBundle."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = folder / "ca.key", folder / "ca.crt"
    _openssl(
        "req",
        "-x509",
        "-new",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=mstar-test-lws-ca",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca_crt),
    )
    csr, ext = folder / "tls.csr", folder / "ext.cnf"
    ext.write_text(
        "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1\n"
    )
    _openssl(
        "req",
        "-new",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        str(folder / "tls.key"),
        "-out",
        str(csr),
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca_crt),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        str(ext),
        "-out",
        str(folder / "tls.crt"),
    )
    return ca_crt.read_bytes()


def webhook_configurations(config: Path, port: int, ca: bytes) -> list[dict[str, Any]]:
    """The module's webhook configurations with its patches, each hook aimed at
    https://127.0.0.1:`port` + the path of the Service it named."""
    docs = [d for d in yaml.safe_load_all((config / "webhook" / "manifests.yaml").read_text()) if d]
    for doc in docs:
        for op in yaml.safe_load((config / "webhook" / WEBHOOK_PATCHES[doc["kind"]]).read_text()):
            head, _, index = op["path"].rpartition("/")
            assert (op["op"], head) == ("replace", "/webhooks"), op
            doc["webhooks"][int(index)] = op["value"]
        doc["metadata"]["name"] = f"lws-{doc['metadata']['name']}"  # the kustomize namePrefix
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {
                "url": f"https://127.0.0.1:{port}{path}",
                "caBundle": base64.b64encode(ca).decode(),
            }
    return docs


def _established(cp: ControlPlane) -> bool:
    crd = cp.get("crd", LWS_CRD, "default") or {}
    return any(
        c["type"] == "Established" and c["status"] == "True"
        for c in (crd.get("status") or {}).get("conditions") or []
    )


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


class LwsController:
    """Install the CRDs and webhooks, run the controller; `stop` removes the webhooks (the CRDs
    stay: they are what a cluster with LWS has)."""

    def __init__(self, cp: ControlPlane, workdir: Path) -> None:
        self.cp, self.workdir = cp, workdir
        self.bin = tool_bin("lws")
        self.config = self.bin.parent / "config"
        self.process: Process | None = None
        self.webhooks: list[dict[str, Any]] = []

    def start(self) -> None:
        cp = self.cp
        cp.kubectl("apply", "--server-side", "-f", str(self.config / "crds"))
        wait_until(lambda: _established(cp), "the LWS CRD to be Established", 60)
        certs = self.workdir / "certs"
        ca = make_serving_cert(certs)
        port, health = free_port(), free_port()
        settings = {
            "apiVersion": "config.lws.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"port": port, "host": "127.0.0.1", "certDir": str(certs)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        }
        config_file = self.workdir / "lws-config.yaml"
        config_file.write_text(yaml.safe_dump(settings))
        self.process = Process(
            [str(self.bin / "lws"), f"--config={config_file}", "--leader-elect=false"],
            self.workdir / "lws.log",
            env={"KUBECONFIG": str(cp.kubeconfig), "PATH": "/usr/bin:/bin"},
        )
        wait_until(
            lambda: (
                urllib.request.urlopen(f"http://127.0.0.1:{health}/readyz", timeout=2).status == 200
            ),
            "the LWS controller's readyz",
            120,
            self.process,
        )
        wait_until(lambda: _listening(port), "its webhook server", 60, self.process)
        self.webhooks = webhook_configurations(self.config, port, ca)
        cp.kubectl(
            "apply",
            "-f",
            "-",
            stdin=json.dumps({"kind": "List", "apiVersion": "v1", "items": self.webhooks}),
        )

    def log(self) -> str:
        return self.process.log() if self.process else ""

    def version(self) -> str:
        out = subprocess.run(
            [str(self.bin / "lws"), "--version"], capture_output=True, text=True, check=True
        ).stdout
        return out.split()[1]

    def stop(self) -> None:
        for doc in self.webhooks:
            self.cp.kubectl("delete", doc["kind"], doc["metadata"]["name"], check=False)
        if self.process is not None:
            self.process.stop()
