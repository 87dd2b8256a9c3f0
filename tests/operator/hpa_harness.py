"""prometheus-adapter serving `custom.metrics.k8s.io` to the local control plane's HPA controller.

The apiserver reaches an aggregated API at its Service's endpoints, and Endpoints refuse
loopback addresses, so the adapter runs in a network namespace this harness creates (a veth
pair, a /30 of 10.213.0.0/16: the host side and the namespace side). What the adapter must
reach is offered on the host side: Prometheus listens there, and a TCP relay forwards the
apiserver's port to its loopback address. Traffic stays between this machine's own hosts.
Prometheus (Debian's) scrapes the engine pods on their kwok pod addresses, found from the
apiserver's pod list by their scrape annotations.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from built_tools import Process, free_port, tool_bin, wait_until
from real_cluster import ROOT, ControlPlane

VALUES = ROOT / "charts" / "mstar" / "values.yaml"
ADAPTER_PORT = 6443


def run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")


class NetNamespace:
    """A network namespace joined to the host by a veth pair; deleted by `close`."""

    def __init__(self) -> None:
        n = os.getpid() % 250
        self.name = f"mstar-adapter-{os.getpid()}"
        self.host_ip, self.inner_ip = f"10.213.{n}.1", f"10.213.{n}.2"
        host_if, inner_if = f"mstv{n}h", f"mstv{n}n"
        run("ip", "netns", "add", self.name)
        try:
            run("ip", "link", "add", host_if, "type", "veth", "peer", "name", inner_if)
            run("ip", "link", "set", inner_if, "netns", self.name)
            run("ip", "addr", "add", f"{self.host_ip}/30", "dev", host_if)
            run("ip", "link", "set", host_if, "up")
            inside = ("ip", "netns", "exec", self.name)
            run(*inside, "ip", "addr", "add", f"{self.inner_ip}/30", "dev", inner_if)
            run(*inside, "ip", "link", "set", inner_if, "up")
            run(*inside, "ip", "link", "set", "lo", "up")
        except RuntimeError:
            self.close()
            raise

    def close(self) -> None:
        # Deleting the namespace deletes the veth end inside it, and with it the pair.
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)


class TcpRelay:
    """Forwards connections accepted on (host, port) to 127.0.0.1:port, both ways."""

    def __init__(self, host: str, port: int) -> None:
        self.target = ("127.0.0.1", port)
        self.server = socket.create_server((host, port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.server.close()


def apiserver_port(cp: ControlPlane) -> int:
    server = cp.kubectl_json("config", "view", "--raw")["clusters"][0]["cluster"]["server"]
    return int(str(server).rsplit(":", 1)[1])


class Prometheus(Process):
    """Debian's Prometheus on `host`. Its build leaves out Kubernetes service discovery
    (`kubernetes_sd_configs` is refused), so `discover` does what the pod role would: it writes
    the file_sd targets of pods carrying the operator's scrape annotations, labelled with their
    namespace and pod as the chart's ServiceMonitor labels them."""

    def __init__(self, host: str, folder: Path) -> None:
        self.targets = folder / "targets.json"
        self.targets.write_text("[]")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {
                    "job_name": "engine-pods",
                    "scrape_timeout": "1s",
                    "file_sd_configs": [{"files": [str(self.targets)], "refresh_interval": "1s"}],
                }
            ],
        }
        (folder / "prometheus.yml").write_text(json.dumps(config))
        self.url = f"http://{host}:{free_port(host)}"
        binary = shutil.which("prometheus") or "prometheus"
        super().__init__(
            [binary, f"--config.file={folder / 'prometheus.yml'}",
             f"--storage.tsdb.path={folder / 'tsdb'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            folder / "prometheus.log",
        )  # fmt: skip
        wait_until(lambda: _ok(self.url + "/-/ready"), "Prometheus", 60, self)

    def discover(self, pods: list[dict[str, Any]]) -> None:
        groups = []
        for pod in pods:
            notes = pod["metadata"].get("annotations") or {}
            ip = pod.get("status", {}).get("podIP")
            if notes.get("prometheus.io/scrape") != "true" or not ip:
                continue
            groups.append(
                {
                    "targets": [f"{ip}:{notes['prometheus.io/port']}"],
                    "labels": {
                        "namespace": pod["metadata"]["namespace"],
                        "pod": pod["metadata"]["name"],
                        "__metrics_path__": notes.get("prometheus.io/path", "/metrics"),
                    },
                }
            )
        tmp = self.targets.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.targets)  # atomic: Prometheus never reads half a file


def _ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status == 200


def adapter_kubeconfig(cp: ControlPlane, server: str, path: Path) -> Path:
    """The admin's credentials against `server`, checked as the apiserver's own name."""
    pki = cp.state / "pki"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "local",
                        "cluster": {
                            "server": server,
                            "certificate-authority": str(pki / "ca.crt"),
                            "tls-server-name": "localhost",  # in the apiserver's certificate
                        },
                    }
                ],
                "users": [
                    {
                        "name": "admin",
                        "user": {
                            "client-certificate": str(pki / "admin.crt"),
                            "client-key": str(pki / "admin.key"),
                        },
                    }
                ],
                "contexts": [{"name": "local", "context": {"cluster": "local", "user": "admin"}}],
                "current-context": "local",
            }
        )
    )
    return path


def chart_rules() -> dict[str, Any]:
    """The adapter config the chart's values carry (prometheusAdapter.rules.custom)."""
    values = yaml.safe_load(VALUES.read_text())
    return {"rules": values["prometheusAdapter"]["rules"]["custom"]}


def start_adapter(
    netns: NetNamespace, kubeconfig: Path, prometheus_url: str, folder: Path
) -> Process:
    binary = tool_bin("adapter") / "adapter"
    (folder / "rules.yaml").write_text(yaml.safe_dump(chart_rules()))
    argv = [
        "ip", "netns", "exec", netns.name, str(binary),
        f"--secure-port={ADAPTER_PORT}", f"--bind-address={netns.inner_ip}",
        f"--cert-dir={folder / 'certs'}",
        f"--lister-kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--prometheus-url={prometheus_url}", f"--config={folder / 'rules.yaml'}",
        "--metrics-relist-interval=5s", "--v=1",
    ]  # fmt: skip
    return Process(argv, folder / "adapter.log")


def register_api_service(cp: ControlPlane, netns: NetNamespace, namespace: str) -> None:
    """custom.metrics.k8s.io/v1beta2 at a selector-less Service whose endpoint is the adapter."""
    docs = [
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "custom-metrics", "namespace": namespace},
         "spec": {"ports": [{"port": 443, "targetPort": ADAPTER_PORT, "protocol": "TCP"}]}},
        {"apiVersion": "v1", "kind": "Endpoints",
         "metadata": {"name": "custom-metrics", "namespace": namespace},
         "subsets": [{"addresses": [{"ip": netns.inner_ip}],
                      "ports": [{"port": ADAPTER_PORT, "protocol": "TCP"}]}]},
        {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
         "metadata": {"name": "v1beta2.custom.metrics.k8s.io"},
         "spec": {"group": "custom.metrics.k8s.io", "version": "v1beta2",
                  "service": {"name": "custom-metrics", "namespace": namespace, "port": 443},
                  "insecureSkipTLSVerify": True,
                  "groupPriorityMinimum": 100, "versionPriority": 200}},
    ]  # fmt: skip
    cp.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                    "items": docs}))  # fmt: skip

    def available() -> bool:
        svc = cp.kubectl_json("get", "apiservice", "v1beta2.custom.metrics.k8s.io")
        conditions = svc.get("status", {}).get("conditions") or []
        return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)

    wait_until(available, "the custom metrics APIService to be Available", 120)


def custom_metric(cp: ControlPlane, namespace: str, metric: str) -> dict[str, float]:
    """GET custom.metrics.k8s.io for every pod of `namespace`: pod name -> value."""
    path = f"/apis/custom.metrics.k8s.io/v1beta2/namespaces/{namespace}/pods/*/{metric}"
    items = json.loads(cp.kubectl("get", "--raw", path).stdout)["items"]
    return {i["describedObject"]["name"]: _quantity(i["value"]) for i in items}


def _quantity(value: str) -> float:
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)
