"""`mstar-engine serve [MODEL] ...`: load the model, start the engine loop, serve OpenAI routes.

`mstar-engine prestop` is the pod's preStop hook (see `mstar.engine.prestop`).

Engine flags come from `EngineConfig` (`add_cli_args` / `from_namespace`), the same contract
the operator renders into container args; only `--api-key` and `--log-level` are the
server's own. The API key may also come from `MSTAR_API_KEY`, so it need not sit in a pod spec.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from mstar.engine import prestop as prestop_module
from mstar.engine.config import add_cli_args, from_namespace

API_KEY_ENV = "MSTAR_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mstar-engine", description="mstar LLM engine with an OpenAI-compatible server."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="Serve a model over HTTP (OpenAI routes, /health, /ready, /metrics).",
        description="Serve MODEL (a Hugging Face checkpoint folder or a GGUF file; default: the "
        "packaged SmolLM2, its Q4_1 GGUF dequantized).",
    )
    add_cli_args(serve)
    serve.add_argument(
        "--api-key",
        default=None,
        help=f"Require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}).",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="Logging verbosity.",
    )
    prestop = commands.add_parser(
        "prestop",
        help="preStop hook: wait until the local server gets no more requests (out of rotation).",
        description=prestop_module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prestop_module.add_arguments(prestop)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "prestop":
        return prestop_module.run(args)
    try:
        config = from_namespace(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if (config.node_rank or 0) > 0:
        # A worker pod of a multi-node replica: its ranks run steps; the leader serves HTTP.
        from mstar.engine.parallel.group import RankLayoutError
        from mstar.engine.parallel.worker import serve_node

        try:
            return serve_node(config)
        except RankLayoutError as exc:
            print(f"mstar-engine: error: {exc}", file=sys.stderr)
            return 2
    # Heavy imports (torch, the model) only once the flags are known to be good.
    from mstar.engine.engine import LLMEngine
    from mstar.engine.model.config import ModelLoadError
    from mstar.engine.parallel.group import RankLayoutError
    from mstar.engine.server.app import build_app, serve
    from mstar.engine.server.async_engine import EngineThread
    from mstar.engine.startup_memory import (
        drop_unused_cuda_pages,
        huge_page_share,
        release_freed_heap,
    )
    from mstar.kernels import BackendUnavailable

    # Built on the thread that will step it: one OpenMP team, not two, on the CPU's cores.
    engine_thread = EngineThread()
    try:
        engine = engine_thread.call(lambda: LLMEngine.from_config(config, serving=True))
    except ModelLoadError as exc:
        print(f"mstar-engine: error: cannot load the model: {exc}", file=sys.stderr)
        return 2
    except (BackendUnavailable, RankLayoutError) as exc:
        print(f"mstar-engine: error: {exc}", file=sys.stderr)
        return 2
    # What loading freed, and on CPU the CUDA libraries' pages: `mstar.engine.startup_memory`.
    release_freed_heap()
    if engine.device.type == "cpu":
        log = logging.getLogger(__name__)
        log.info("CPU engine: %d MiB of the CUDA libraries' pages dropped",
                 drop_unused_cuda_pages() >> 10)  # fmt: skip
        share = huge_page_share()
        if share is not None:  # the packed weights' 2 MiB pages (mstar.kernels' README)
            log.info("CPU engine: %d of %d MiB resident in 2 MiB pages", share[0] >> 10,
                     share[1] >> 10)  # fmt: skip
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    app = build_app(
        engine,
        api_key=api_key,
        max_waiting_requests=config.max_waiting_requests,
        engine_thread=engine_thread,
        stall_timeout_seconds=config.stall_timeout_seconds,
        request_timeout_seconds=config.request_timeout_seconds,
    )
    code = asyncio.run(
        serve(
            app,
            config.host,
            config.port,
            grace_seconds=config.shutdown_grace_seconds,
            exit_on_engine_failure=config.exit_on_engine_failure,
        )
    )
    if code == 0:
        engine.close()  # the other ranks of a tensor-parallel replica (the loop has stopped)
    else:
        # The engine died or hangs: a hung engine thread may never let the interpreter finish.
        logging.shutdown()
        os._exit(code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
