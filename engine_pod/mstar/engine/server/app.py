"""The aiohttp app: routes, middlewares (OpenAI-shaped errors, API key), health and readiness
probes, models, metrics, the OpenAPI document; serving with signals and drain.

The generation routes are `lifecycle.generate` (one request's life) and `responses` (the
OpenAI body or event stream); what every handler shares is `state.ServerState`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from mstar.engine.config import EngineConfig
from mstar.engine.resources.kv import KVCacheResource
from mstar.engine.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineLike,
    EngineThread,
)
from mstar.engine.server.errors import APIError
from mstar.engine.server.lifecycle import generate
from mstar.engine.server.liveness import Liveness
from mstar.engine.server.lora_routes import adapter_cards, lora_of, register_lora
from mstar.engine.server.metrics import CacheConfig, ServerMetrics
from mstar.engine.server.openapi import openapi_document
from mstar.engine.server.state import STATE, ServerState
from mstar.engine.server.telemetry import Telemetry
from mstar.engine.server.tokenize import detokenize, tokenize, tokenizer_info
from mstar.kernels.cpu_kernels import loaded_level

log = logging.getLogger(__name__)

#: After the grace period, how long aiohttp waits before cancelling the handlers still running.
SHUTDOWN_CUTOFF_SECONDS = 1.0
#: How often the watchdog asks whether the engine stalled (a fraction of any sensible bound).
WATCHDOG_SECONDS = 0.5
_DEFAULTS = EngineConfig()


class OneLinePayloadErrors(logging.Filter):
    """One log line, no traceback, for a body that cannot be read.

    `read_json_body` answers such a body 400 (e.g. bytes that do not match their
    `Content-Encoding`), but aiohttp then reads the rest of it to keep the connection
    (lingering close), meets the stored `RequestPayloadError` again and logs it on
    ``aiohttp.server`` as "Unhandled exception" with a traceback. It is the client's input,
    already answered: a warning line says so.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, RequestPayloadError):
            record.msg = "dropped the rest of an unreadable request body (answered 400): %s"
            record.args = (" ".join(str(exc).split()),)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def _one_line_payload_errors() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, OneLinePayloadErrors) for f in server_log.filters):
        server_log.addFilter(OneLinePayloadErrors())


# -- middlewares ---------------------------------------------------------------------------------


def _error_response(err: APIError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every failure answers in OpenAI's error shape, aiohttp's own 404/405 included."""
    try:
        return await handler(request)
    except APIError as err:
        return _error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return _error_response(APIError(exc.status, exc.reason, type=kind, headers=allow))
    except (ConnectionResetError, asyncio.CancelledError):
        raise  # the client is gone; nobody to answer
    except Exception as exc:
        log.exception("unhandled error on %s", request.path)
        return _error_response(
            APIError(500, f"internal error: {exc}", type="internal_server_error")
        )


@web.middleware
async def auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    key = request.app[STATE].api_key
    if key and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        # aiohttp keeps header bytes that are not UTF-8 as surrogate escapes: compare the bytes
        # the client sent, so a malformed header is just a wrong key (401).
        sent = token.encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(sent, key.encode()):
            raise APIError(
                401,
                "Incorrect API key provided." if token else "Missing API key (Authorization).",
                type="invalid_request_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
    return await handler(request)


# -- probes, models, metrics --------------------------------------------------------------------


def _engine_trouble(state: ServerState) -> tuple[str, str] | None:
    """(status, reason) when the engine is dead or hung; None while it makes progress."""
    engine = state.async_engine
    if not engine.alive:
        return "dead", str(engine.error or "the engine loop is not running")
    stall = engine.liveness.stall()
    return ("stalled", stall) if stall is not None else None


async def health(request: web.Request) -> web.Response:
    """Liveness: the engine loop runs and, with work pending, completes steps within its bound
    (a dead or hung loop needs a restart, not more traffic). Also the ISA level of the CPU
    kernels the engine runs (null: none, e.g. on a GPU)."""
    trouble = _engine_trouble(request.app[STATE])
    if trouble is not None:
        return web.json_response({"status": trouble[0], "error": trouble[1]}, status=503)
    return web.json_response({"status": "ok", "cpu_isa": loaded_level()})


async def ready(request: web.Request) -> web.Response:
    """Readiness: model loaded, engine loop alive and not hung, not draining (503 from the
    first drain step).

    Also says how long ago the last request arrived: `mstar-engine prestop` waits on it.
    """
    state = request.app[STATE]
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    trouble = _engine_trouble(state)
    if trouble is not None:
        return web.json_response({"status": f"engine {trouble[0]}: {trouble[1]}"}, status=503)
    idle = round(time.monotonic() - state.last_arrival, 3)
    return web.json_response(
        {"status": "ready", "model": state.model_name, "since_last_request_s": idle}
    )


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "mstar",
        "root": state.model_name,
        "max_model_len": state.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card, *adapter_cards(state)]})


async def openapi(request: web.Request) -> web.Response:
    state = request.app[STATE]
    guarded, lora = state.api_key is not None, lora_of(state) is not None
    doc = openapi_document(state.model_name, state.max_model_len, guarded=guarded, lora=lora)
    return web.json_response(doc)


def build_app(
    engine: EngineLike,
    *,
    api_key: str | None = None,
    max_waiting_requests: int = 256,
    telemetry: Telemetry | None = None,
    engine_thread: EngineThread | None = None,
    stall_timeout_seconds: float = _DEFAULTS.stall_timeout_seconds,
    request_timeout_seconds: float = _DEFAULTS.request_timeout_seconds,
) -> web.Application:
    """The served app; the engine loop starts with the app and stops with it.

    ``engine_thread``: the thread ``engine`` was built on, so its steps run there too (see
    `EngineThread`); without one the steps get a thread of their own. The timeouts are
    `EngineConfig`'s (``--stall-timeout-seconds``, ``--request-timeout-seconds``).
    """
    _one_line_payload_errors()
    kv = engine.kv
    cache = CacheConfig(kv.page_size, kv.num_pages, kv.config.host_offload_pages)
    decoder = getattr(engine, "decoder", None)  # test fakes have none
    metrics_ = ServerMetrics(
        engine.model_name,
        cache,
        getattr(decoder, "parameter_counts", None),
        (kv.pages_by_label, kv.cache.page_bytes) if isinstance(kv, KVCacheResource) else None,
    )
    state = ServerState(
        engine=engine,
        async_engine=AsyncEngine(
            engine,
            observer=metrics_,
            thread=engine_thread,
            liveness=Liveness(stall_timeout_seconds),
        ),
        metrics=metrics_,
        telemetry=telemetry if telemetry is not None else Telemetry.from_env(),
        model_name=engine.model_name,
        max_model_len=engine.max_model_len,
        api_key=api_key or None,
        max_waiting_requests=max_waiting_requests,
        request_timeout=request_timeout_seconds or None,
    )
    state.idle.set()
    app = web.Application(middlewares=[error_middleware, auth_middleware])
    app[STATE] = state

    async def chat(request: web.Request) -> web.StreamResponse:
        return await generate(request, "chat")

    async def completions(request: web.Request) -> web.StreamResponse:
        return await generate(request, "completion")

    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    register_lora(app)

    async def on_startup(app: web.Application) -> None:
        app[STATE].async_engine.start()
        watchdog = asyncio.create_task(watch_engine(app[STATE].async_engine))
        app[WATCHDOG] = watchdog

    async def on_cleanup(app: web.Application) -> None:
        st = app[STATE]
        app[WATCHDOG].cancel()
        await asyncio.get_running_loop().run_in_executor(None, st.async_engine.stop)
        st.telemetry.shutdown()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


WATCHDOG: web.AppKey[asyncio.Task[None]] = web.AppKey("mstar_watchdog", asyncio.Task)


async def watch_engine(engine: AsyncEngine) -> None:
    """Declare a hung engine (or one whose thread is gone, or whose tensor-parallel rank died:
    `LLMEngine.failure`) dead: its requests end with the reason at once, rather than whenever a
    kubelet gets round to restarting the pod. Cancelled before a normal shutdown stops it."""
    while engine.error is None:
        await asyncio.sleep(WATCHDOG_SECONDS)
        reason = engine.liveness.stall() if engine.alive else "the engine thread is gone"
        failure = getattr(engine.engine, "failure", None)  # a tensor-parallel rank died
        reason = reason or (failure() if failure is not None else None)
        if reason is not None and engine.error is None:
            log.error("%s; failing its requests", reason)
            engine.fail(EngineDeadError(reason))


async def drain(app: web.Application, grace_seconds: float) -> bool:
    """Stop taking requests (`/ready` 503), let in-flight ones finish for up to the grace.

    Returns True when everything finished in time. Otherwise the rest are aborted (their
    clients get what was generated, with finish_reason "abort") and False is returned.
    """
    state = app[STATE]
    state.draining = True
    try:
        await asyncio.wait_for(state.idle.wait(), timeout=grace_seconds)
        return True
    except TimeoutError:
        pass
    for gen in list(state.generations):
        gen.abort()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(state.idle.wait(), timeout=SHUTDOWN_CUTOFF_SECONDS)
    return False


async def serve(
    app: web.Application,
    host: str,
    port: int,
    *,
    grace_seconds: float = 30.0,
    stop: asyncio.Event | None = None,
    on_started: Callable[[int], None] | None = None,
    exit_on_engine_failure: bool = True,
) -> int:
    """Run until SIGTERM/SIGINT (or `stop`), drain, then shut down: returns 0. With
    ``exit_on_engine_failure``, an engine that dies or hangs ends it too (its requests have
    failed; their handlers get a moment to say so): returns 1, for a restart.

    Handlers are cancelled when their client disconnects (`handler_cancellation`), which is
    what aborts a disconnected request's engine work and frees its pages.
    """
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_CUTOFF_SECONDS
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = getattr(site._server, "sockets", None)
    bound = sockets[0].getsockname()[1] if sockets else port
    log.info("serving %s on http://%s:%s", app[STATE].model_name, host, bound)
    if on_started is not None:
        on_started(bound)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            pass
    state = app[STATE]
    waits = [asyncio.ensure_future(stop.wait())]
    if exit_on_engine_failure:
        waits.append(asyncio.ensure_future(state.async_engine.dead.wait()))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if state.async_engine.dead.is_set():
            log.error("the engine failed (%s); exiting", state.async_engine.error)
            state.draining = True
            with contextlib.suppress(TimeoutError):  # the failed handlers write their errors
                await asyncio.wait_for(state.idle.wait(), timeout=SHUTDOWN_CUTOFF_SECONDS)
            return 1
        log.info("draining: waiting up to %.1fs for %d requests", grace_seconds, state.inflight)
        if not await drain(app, grace_seconds):
            log.warning("grace period over; cut off the requests still running")
        return 0
    finally:
        for waiting in waits:
            waiting.cancel()
        for sig in installed:
            loop.remove_signal_handler(sig)
        await runner.cleanup()
