"""A real engine server for tests: `mstar.engine.server.app.serve` on a free loopback port.

`LiveServer` runs the same code `mstar-engine serve` runs on a thread with its own event loop,
so tests talk to it over real HTTP (the official `openai` client, raw aiohttp, Prometheus).
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from mstar.engine.config import EngineConfig
from mstar.engine.server.app import build_app, serve

#: Words of the tiny model's vocabulary frame each chat turn (unknown words map to w0).
CHAT_TEMPLATE = (
    "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
    "{% if add_generation_prompt %}w5{% endif %}"
)


def add_chat_template(folder: Path) -> Path:
    """Give a tiny model folder `CHAT_TEMPLATE` (in place); returns the folder."""
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_file.write_text(json.dumps(cfg))
    return folder


def make_engine(model_dir: Path, **overrides: Any) -> Any:
    from mstar.engine.engine import LLMEngine

    settings: dict[str, Any] = {
        "model": str(model_dir),
        "served_model_name": "tiny",
        "device": "cpu",
        "dtype": "float32",
        "num_pages": 256,
        "page_size": 4,
        "max_num_seqs": 32,
        "host_offload_gb": 0.01,
    }
    settings.update(overrides)
    return LLMEngine.from_config(EngineConfig(**settings))


class LiveServer:
    """The real app served on 127.0.0.1:<free port> from a background thread."""

    def __init__(self, engine: Any, grace_seconds: float = 5.0, **app_kwargs: Any) -> None:
        self.engine = engine
        self.app_kwargs = app_kwargs
        self.grace_seconds = grace_seconds
        self.port = 0
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="live-server", daemon=True)
        self.error: BaseException | None = None
        self.app: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self.app = build_app(self.engine, **self.app_kwargs)

            def started(port: int) -> None:
                self.port = port
                self._started.set()

            await serve(
                self.app,
                "127.0.0.1",
                0,
                grace_seconds=self.grace_seconds,
                stop=self._stop,
                on_started=started,
            )

        try:
            asyncio.run(main())
        except BaseException as exc:
            self.error = exc
            self._started.set()

    def start(self) -> LiveServer:
        self._thread.start()
        assert self._started.wait(60), "server did not start"
        if self.error is not None:
            raise self.error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- helpers -------------------------------------------------------------------------------

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> Any:
        """POST a JSON body; the decoded JSON answer (an HTTP error raises)."""
        req = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        status, text = self.get("/metrics")
        assert status == 200
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        """The value of one series; a series that is not exported is an error, never 0."""
        labels = {"model_name": "tiny", **labels}
        samples = self.metrics()
        key = (name, tuple(sorted(labels.items())))
        if key not in samples:
            present = [dict(lbl) for n, lbl in samples if n == name]
            raise KeyError(f"/metrics has no {name}{labels}; series of that name: {present}")
        return samples[key]

    def wait_metric(self, name: str, target: float, timeout: float = 10.0, **labels: str) -> None:
        """Poll /metrics until `name` equals `target` (gauges settle after the last step).

        A missing series fails at once (`metric` raises): waiting cannot make it appear."""
        import time

        deadline = time.monotonic() + timeout
        while (value := self.metric(name, **labels)) != target:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}{labels} = {value}, expected {target}")
            time.sleep(0.05)


class BackgroundLoad:
    """``workers`` threads each posting completions back to back until the block exits.

    ``body(worker)`` gives each request's JSON body (called per request, so it may vary).
    """

    def __init__(
        self,
        url: str,
        workers: int,
        body: Callable[[int], dict[str, Any]],
        timeout: float = 120.0,
    ) -> None:
        self.url = url
        self.body = body
        self.timeout = timeout
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)
        ]

    def _run(self, worker: int) -> None:
        while not self._stop.is_set():
            req = urllib.request.Request(
                self.url + "/v1/completions",
                json.dumps(self.body(worker)).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                resp.read()

    def __enter__(self) -> BackgroundLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout)
