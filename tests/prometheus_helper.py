"""A real Prometheus for tests: started on a free loopback port, scraping the given targets.

    with run_prometheus(["127.0.0.1:8000"]) as base_url:
        wait_for_series(base_url, "mstar:num_requests_running")
        rows = query(base_url, 'sum(mstar:num_requests_running)')

Uses the `prometheus` binary on PATH (Debian's package; scripts/install-test-tools.sh installs it).
Tests that need it call `external_tools.require_tool("prometheus")` first (skip, or fail in CI).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        payload = json.loads(resp.read())
    assert isinstance(payload, dict)
    return payload


@contextlib.contextmanager
def run_prometheus(
    targets: list[str],
    scrape_interval: str = "1s",
    metrics_path: str = "/metrics",
    startup_timeout: float = 60.0,
    labels: dict[str, str] | None = None,
) -> Iterator[str]:
    """Run Prometheus scraping `targets` ("host:port"); yields its base URL, stops it on exit.

    `labels` are attached to every scraped series, as service discovery and relabeling attach
    `namespace`, `pod`, ... in a cluster.
    """
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not installed (see scripts/install-test-tools.sh)")
    with tempfile.TemporaryDirectory(prefix="mstar-prom-") as tmp:
        workdir = Path(tmp)
        config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "scrape_configs": [
                {
                    "job_name": "mstar",
                    "metrics_path": metrics_path,
                    "scrape_timeout": scrape_interval,
                    "static_configs": [{"targets": list(targets), "labels": labels or {}}],
                }
            ],
        }
        (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is valid YAML
        port = _free_port()
        base_url = f"http://127.0.0.1:{port}"
        log = (workdir / "prometheus.log").open("wb")
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
                "--web.enable-lifecycle",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + startup_timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        "prometheus exited: " + (workdir / "prometheus.log").read_text()[-2000:]
                    )
                try:
                    with urllib.request.urlopen(f"{base_url}/-/ready", timeout=2) as resp:
                        if resp.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("prometheus did not become ready")
                time.sleep(0.2)
            yield base_url
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            log.close()


def query(base_url: str, promql: str, at: float | None = None) -> list[dict[str, Any]]:
    """Evaluate an instant query; returns the result rows, raises ValueError on a PromQL error."""
    params = {"query": promql}
    if at is not None:
        params["time"] = str(at)
    url = f"{base_url}/api/v1/query?{urllib.parse.urlencode(params)}"
    try:
        payload = _get(url)
    except urllib.error.HTTPError as exc:  # 400/422 carry the PromQL error as JSON
        payload = json.loads(exc.read() or b"{}")
    if payload.get("status") != "success":
        raise ValueError(f"{promql!r}: {payload.get('errorType')}: {payload.get('error')}")
    result = payload["data"]["result"]
    return list(result) if isinstance(result, list) else [result]


def targets_up(base_url: str) -> bool:
    """All scrape targets have been scraped successfully at least once."""
    active = _get(f"{base_url}/api/v1/targets")["data"]["activeTargets"]
    return bool(active) and all(t.get("health") == "up" for t in active)


def wait_for_series(base_url: str, promql: str, timeout: float = 60.0, min_rows: int = 1) -> None:
    """Poll until `promql` returns at least `min_rows` rows (e.g. after a few scrapes)."""
    deadline = time.monotonic() + timeout
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = query(base_url, promql)
        if len(rows) >= min_rows:
            return
        time.sleep(0.25)
    raise TimeoutError(f"no data for {promql!r} after {timeout:.0f}s (got {rows})")
