"""The aiohttp app: OpenAI routes over `AsyncEngine`, health probes, metrics, traces, drain.

One HTTP request fans out to `len(prompts) * n` engine requests. Each has a `ChoiceState`
turning its tokens into text; stop strings end a choice here (then the engine request is
aborted). Whatever ends a handler (success, error, client disconnect, cancellation) runs the
same `finally`: every engine request not yet finished is aborted, so its pages are freed, and
each choice is counted once in the metrics and traced once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from mstar.engine.model.tokenizer import IncrementalDetokenizer
from mstar.engine.outputs import ErrorKind, RequestError, RequestOutput
from mstar.engine.sampling_params import InvalidParameter
from mstar.engine.server import sse
from mstar.engine.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineLike,
    EngineThread,
    NewRequest,
)
from mstar.engine.server.generation import ChoiceState, Delta, chat_logprobs, completion_logprobs
from mstar.engine.server.metrics import ServerMetrics
from mstar.engine.server.openapi import openapi_document
from mstar.engine.server.protocol import (
    APIError,
    GenerationRequest,
    bad_request,
    decode_json_body,
    model_not_found,
    parse_chat_request,
    parse_completion_request,
)
from mstar.engine.telemetry import Telemetry

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1
#: After the grace period, how long aiohttp waits before cancelling the handlers still running.
SHUTDOWN_CUTOFF_SECONDS = 1.0


@dataclass
class ServerState:
    """Everything the handlers share; one per app."""

    engine: EngineLike
    async_engine: AsyncEngine
    metrics: ServerMetrics
    telemetry: Telemetry
    model_name: str
    max_model_len: int
    api_key: str | None
    max_waiting_requests: int
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    #: When the last request arrived (monotonic); the preStop hook waits for a quiet spell.
    last_arrival: float = field(default_factory=time.monotonic)
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    generations: set[Generation] = field(default_factory=set)

    def enter(self) -> None:
        self.inflight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()


STATE: web.AppKey[ServerState] = web.AppKey("mstar_state", ServerState)


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


async def health(request: web.Request) -> web.Response:
    """Liveness: the engine loop runs (a dead loop needs a restart, not more traffic)."""
    state = request.app[STATE]
    if not state.async_engine.alive:
        error = str(state.async_engine.error)
        return web.json_response({"status": "dead", "error": error}, status=503)
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Readiness: model loaded, engine loop alive, not draining (503 from the first drain step).

    Also says how long ago the last request arrived: `mstar-engine prestop` waits on it.
    """
    state = request.app[STATE]
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    if not state.async_engine.alive:
        return web.json_response({"status": "engine not running"}, status=503)
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
    return web.json_response({"object": "list", "data": [card]})


async def openapi(request: web.Request) -> web.Response:
    state = request.app[STATE]
    doc = openapi_document(state.model_name, state.max_model_len, guarded=state.api_key is not None)
    return web.json_response(doc)


# -- generation ----------------------------------------------------------------------------------


async def read_json_body(request: web.Request) -> Any:
    """The request's JSON body; a body that cannot be read, decompressed or decoded is a 400.

    Reading can fail in aiohttp (a `Content-Encoding` the bytes do not match, a malformed
    chunked body); everything after the bytes is `decode_json_body`'s. Too large a body stays
    aiohttp's 413.
    """
    try:
        raw = await request.read()
    except (HttpProcessingError, RequestPayloadError) as exc:
        reason = " ".join(str(exc.__cause__ or exc).split())
        raise bad_request(f"Cannot read the request body: {reason}") from exc
    try:
        charset = request.charset
    except ValueError as exc:  # a Content-Type header aiohttp cannot parse
        raise bad_request(f"Invalid Content-Type header: {exc}") from exc
    return decode_json_body(raw, charset)


@dataclass
class SubRequest:
    """One engine request: prompt `prompt_index`, choice `index` of the response."""

    request_id: str
    index: int
    prompt_index: int
    prompt_ids: list[int]
    choice: ChoiceState
    last: RequestOutput | None = None
    #: The engine accepted it; until then there is nothing to abort, count or trace.
    submitted: bool = False
    done: bool = False
    error: RequestError | None = None


class Generation:
    """The life of one completion / chat request."""

    def __init__(self, request: web.Request, kind: str) -> None:
        self.request = request
        self.state = request.app[STATE]
        self.kind = kind
        self.arrival = time.monotonic()
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.subs: list[SubRequest] = []
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.req: GenerationRequest | None = None
        self.prompt_texts: list[str] = []
        self.status = 200
        self.error: str | None = None
        self.trace = self.state.telemetry.start_request(
            request.headers,
            {
                "gen_ai.request.id": self.id,
                "gen_ai.system": "mstar",
                "gen_ai.operation.name": "chat" if kind == "chat" else "text_completion",
                "http.request.method": request.method,
                "url.path": request.path,
            },
            start=self.arrival,
        )

    # -- setup ---------------------------------------------------------------------------------

    async def parse(self) -> GenerationRequest:
        body = await read_json_body(self.request)
        req = parse_chat_request(body) if self.kind == "chat" else parse_completion_request(body)
        if req.model is not None and req.model != self.state.model_name:
            raise model_not_found(req.model)
        self.req = req
        p = req.params
        self.trace.span.set_attributes(
            {
                "gen_ai.request.model": req.model or self.state.model_name,
                "gen_ai.response.model": self.state.model_name,
                "gen_ai.request.temperature": p.temperature,
                "gen_ai.request.top_p": p.top_p,
                "gen_ai.request.top_k": p.top_k,
                "gen_ai.request.n": req.n,
                "gen_ai.request.stream": req.stream,
            }
        )
        if p.seed is not None:
            self.trace.span.set_attribute("gen_ai.request.seed", p.seed)
        if req.max_tokens is not None:
            self.trace.span.set_attribute("gen_ai.request.max_tokens", req.max_tokens)
        return req

    def tokenize(self, req: GenerationRequest) -> list[list[int]]:
        tok = self.state.engine.tokenizer
        if req.kind == "chat":
            try:
                text = tok.apply_chat_template(req.messages, add_generation_prompt=True)
            except Exception as exc:  # template errors are the conversation's fault
                raise bad_request(f"Cannot apply the chat template: {exc}", "messages") from exc
            self.prompt_texts = [text]
            return [_encode(tok, text, "messages")]
        ids: list[list[int]] = []
        for prompt in req.prompts:
            if isinstance(prompt, str):
                self.prompt_texts.append(prompt)
                ids.append(_encode(tok, prompt, "prompt"))
            else:
                self.prompt_texts.append("")
                ids.append(list(prompt))
        return ids

    def plan(self, req: GenerationRequest, prompts: list[list[int]]) -> list[NewRequest]:
        tok = self.state.engine.tokenizer
        new: list[NewRequest] = []
        for p_idx, ids in enumerate(prompts):
            for i in range(req.n):
                index = p_idx * req.n + i
                params = req.sampling_params(len(ids), self.state.max_model_len, i)
                rid = f"{self.id}-{index}"
                detok = IncrementalDetokenizer(
                    tok, ids, skip_special_tokens=req.skip_special_tokens
                )
                choice = ChoiceState(
                    index,
                    detok,
                    stop=req.stop,
                    include_stop_str_in_output=req.include_stop_str_in_output,
                )
                self.subs.append(SubRequest(rid, index, p_idx, ids, choice))
                new.append(
                    NewRequest(rid, ids, params, self._sink(len(self.subs) - 1), self.arrival)
                )
        self.trace.span.set_attribute("gen_ai.request.max_tokens", new[0].params.max_tokens)
        return new

    def _sink(self, position: int) -> Callable[[RequestOutput], None]:
        put = self.queue.put_nowait
        return lambda out: put((position, out))

    async def submit(self, req: GenerationRequest, new: list[NewRequest]) -> None:
        state = self.state
        if state.async_engine.num_waiting() + len(new) > state.max_waiting_requests:
            raise APIError(
                429,
                f"The server is at capacity ({state.max_waiting_requests} waiting requests); "
                "retry later.",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        try:
            await state.async_engine.add_requests(new)
            for sub in self.subs:
                sub.submitted = True
        except asyncio.CancelledError:
            for sub in self.subs:
                sub.done = True  # add_requests already aborted them
            raise
        except InvalidParameter as exc:
            for sub in self.subs:
                sub.done = True  # the engine already undid the batch
            param = {"prompt": req.prompt_param, "max_tokens": req.max_tokens_param}.get(
                exc.param, exc.param
            )
            raise bad_request(str(exc), param) from exc
        except EngineDeadError as exc:
            for sub in self.subs:
                sub.done = True
            raise APIError(503, str(exc), type="service_unavailable") from exc
        except ValueError as exc:
            for sub in self.subs:
                sub.done = True
            raise bad_request(str(exc)) from exc
        except Exception as exc:
            for sub in self.subs:
                sub.done = True
            raise APIError(
                500, f"the engine refused the request: {exc}", type="internal_server_error"
            ) from exc

    # -- consuming outputs ---------------------------------------------------------------------

    async def next_deltas(self) -> list[tuple[SubRequest, Delta]]:
        """Wait for engine output; return what can be shown now (may be empty)."""
        position, out = await self.queue.get()
        ready = [self._absorb(position, out)]
        while not self.queue.empty():  # whatever else the same step delivered
            position, out = self.queue.get_nowait()
            ready.append(self._absorb(position, out))
        return [(sub, d) for sub, d in ready if d is not None]

    def _absorb(self, position: int, out: RequestOutput) -> tuple[SubRequest, Delta | None]:
        sub = self.subs[position]
        # Events first: /metrics counted them, so the span shows them even after a stop string
        # ended the choice while the engine was still stepping it.
        self.state.telemetry.add_events(
            self.trace,
            out.events,
            {"mstar.choice": sub.index, "mstar.engine_request_id": sub.request_id},
        )
        if sub.done:
            return sub, None
        sub.last = out
        choice = sub.choice
        if choice.add(out.new_token_ids, out.new_logprobs):
            self.state.async_engine.abort_request(sub.request_id)
            self._finalize(sub, "stop")
        elif out.finished:
            if out.error is not None:
                sub.error = out.error
            choice.finish(out.finish_reason or "stop")
            self._finalize(sub, choice.finish_reason or "stop")
        return sub, choice.take()

    def _finalize(self, sub: SubRequest, reason: str) -> None:
        """Count and trace one choice exactly once, whatever ended it."""
        if sub.done:
            return
        sub.done = True
        last = sub.last
        now = time.monotonic()
        finished = last.finished_time if last and last.finished_time else now
        scheduled = last.first_scheduled_time if last else None
        first_token = last.first_token_time if last else None
        self.state.metrics.observe_request(
            reason,
            arrival=self.arrival,
            finished=finished,
            first_scheduled=scheduled,
            first_token=first_token,
        )
        self.state.telemetry.add_phases(
            self.trace,
            arrival=self.arrival,
            first_scheduled=scheduled,
            first_token=first_token,
            finished=finished,
            attributes={"mstar.choice": sub.index, "mstar.engine_request_id": sub.request_id},
        )

    def abort(self) -> None:
        """Cut the request short (shutdown): its choices end with finish_reason "abort"."""
        for sub in self.subs:
            if sub.submitted and not sub.done:
                self.state.async_engine.abort_request(sub.request_id)

    def pending(self) -> bool:
        return any(not s.done for s in self.subs)

    def failure(self) -> APIError | None:
        """The error to report when every choice failed before producing text."""
        failed = [s for s in self.subs if s.error is not None]
        if not failed:
            return None
        error = failed[0].error
        assert self.req is not None and error is not None
        if error.kind is ErrorKind.REJECTED:
            return bad_request(error.message, self.req.prompt_param)
        return APIError(500, error.message, type="internal_server_error")

    # -- finishing -----------------------------------------------------------------------------

    def close(self) -> None:
        """Abort what still runs (disconnect, error, shutdown), then end the span."""
        for sub in self.subs:
            if sub.submitted and not sub.done:
                self.state.async_engine.abort_request(sub.request_id)
                sub.choice.finish("abort")
                self._finalize(sub, "abort")
        completion_tokens = sum(s.choice.num_tokens for s in self.subs)
        attrs: dict[str, Any] = {
            "gen_ai.usage.prompt_tokens": self.prompt_tokens(),
            "gen_ai.usage.completion_tokens": completion_tokens,
            "http.response.status_code": self.status,
        }
        reasons = [s.choice.finish_reason or "abort" for s in self.subs if s.submitted]
        if reasons:
            attrs["gen_ai.response.finish_reasons"] = reasons
        first = self.subs[0].last if self.subs else None
        if first is not None:
            a = self.arrival
            if first.first_token_time is not None:
                attrs["gen_ai.latency.time_to_first_token"] = first.first_token_time - a
            if first.first_scheduled_time is not None:
                attrs["gen_ai.latency.time_in_queue"] = first.first_scheduled_time - a
                end = first.finished_time or time.monotonic()
                attrs["gen_ai.latency.time_in_model_inference"] = end - first.first_scheduled_time
                if first.first_token_time is not None:
                    attrs["gen_ai.latency.time_in_model_prefill"] = (
                        first.first_token_time - first.first_scheduled_time
                    )
                    attrs["gen_ai.latency.time_in_model_decode"] = end - first.first_token_time
            attrs["gen_ai.usage.cached_tokens"] = first.num_cached_tokens
        end = time.monotonic()
        attrs["gen_ai.latency.e2e"] = end - self.arrival
        self.state.telemetry.end_request(self.trace, attrs, end, error=self.error)

    def prompt_tokens(self) -> int:
        seen: dict[int, int] = {}
        for s in self.subs:
            seen[s.prompt_index] = len(s.prompt_ids)
        return sum(seen.values())

    def usage(self) -> dict[str, int]:
        prompt = self.prompt_tokens()
        completion = sum(s.choice.num_tokens for s in self.subs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    # -- response bodies -----------------------------------------------------------------------

    def logprobs_body(self, sub: SubRequest, delta: Delta) -> dict[str, Any] | None:
        req = self.req
        assert req is not None
        if req.top_logprobs is None:
            return None
        tok = self.state.engine.tokenizer
        if req.kind == "chat":
            return chat_logprobs(tok, delta.pieces, req.top_logprobs)
        return completion_logprobs(tok, delta.pieces, 0)

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        assert self.req is not None
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
        }
        if self.req.include_usage:
            body["usage"] = None
        return body

    def stream_choice(self, sub: SubRequest, delta: Delta) -> dict[str, Any]:
        lp = self.logprobs_body(sub, delta)
        if self.kind == "chat":
            content: dict[str, Any] = {"content": delta.text} if delta.text else {}
            return {
                "index": sub.index,
                "delta": content,
                "logprobs": lp,
                "finish_reason": delta.finish_reason,
            }
        return {
            "index": sub.index,
            "text": delta.text,
            "logprobs": lp,
            "finish_reason": delta.finish_reason,
        }


def _encode(tok: Any, text: str, param: str) -> list[int]:
    """Tokenize prompt text; text the tokenizer cannot take is the request's fault (400)."""
    try:
        return list(tok.encode(text, add_special_tokens=False))
    except Exception as exc:
        raise bad_request(f"Cannot tokenize the {param}: {exc}", param) from exc


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE]
    state.last_arrival = time.monotonic()
    if state.draining:  # a router that has not let go yet: send it elsewhere
        raise APIError(
            503,
            "The server is shutting down; retry on another replica.",
            type="service_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    state.enter()
    gen = Generation(request, kind)
    state.generations.add(gen)
    try:
        req = await gen.parse()
        prompts = gen.tokenize(req)
        new = gen.plan(req, prompts)
        await gen.submit(req, new)
        if req.stream:
            return await _stream(gen, req)
        return await _complete(gen, req)
    except APIError as err:
        gen.status = err.status
        gen.error = err.message
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        gen.status = 499  # nginx's "client closed request"
        gen.error = "client disconnected"
        raise
    finally:
        state.generations.discard(gen)
        gen.close()
        state.leave()


async def _complete(gen: Generation, req: GenerationRequest) -> web.Response:
    texts: dict[int, list[str]] = {s.index: [] for s in gen.subs}
    logprobs: dict[int, list[dict[str, Any]]] = {s.index: [] for s in gen.subs}
    while gen.pending():
        for sub, delta in await gen.next_deltas():
            texts[sub.index].append(delta.text)
            lp = gen.logprobs_body(sub, delta)
            if lp is not None:
                logprobs[sub.index].append(lp)
    failure = gen.failure()
    if failure is not None:
        raise failure
    choices = []
    for sub in gen.subs:
        text = "".join(texts[sub.index])
        lp = None
        if req.top_logprobs is not None:
            lp = _merge_logprobs(logprobs[sub.index], req.kind)
        if req.kind == "chat":
            choices.append(
                {
                    "index": sub.index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": lp,
                    "finish_reason": sub.choice.finish_reason,
                }
            )
        else:
            if req.echo:
                prompt = gen.prompt_texts[sub.prompt_index] or gen.state.engine.tokenizer.decode(
                    sub.prompt_ids
                )
                text = prompt + text
            choices.append(
                {
                    "index": sub.index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": sub.choice.finish_reason,
                }
            )
    body = {
        "id": gen.id,
        "object": "chat.completion" if req.kind == "chat" else "text_completion",
        "created": gen.created,
        "model": gen.state.model_name,
        "choices": choices,
        "usage": gen.usage(),
    }
    return web.json_response(body)


def _merge_logprobs(parts: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    if kind == "chat":
        return {"content": [entry for p in parts for entry in p["content"]]}
    merged: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for p in parts:
        for key in merged:
            merged[key].extend(p[key])
    return merged


async def _stream(gen: Generation, req: GenerationRequest) -> web.StreamResponse:
    response: web.StreamResponse | None = None
    try:
        while gen.pending():
            deltas = await gen.next_deltas()
            if not deltas:
                continue
            if response is None:
                failure = gen.failure() if all(s.done for s in gen.subs) else None
                if failure is not None and not any(d.text for _, d in deltas):
                    raise failure
                response = await sse.open_stream(gen.request)
                if req.kind == "chat":
                    role = [
                        {
                            "index": s.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        for s in gen.subs
                    ]
                    await response.write(sse.encode_event(gen.chunk(role)))
            for sub, delta in deltas:
                if sub.error is not None and delta.finish_reason is not None:
                    err = APIError(500, sub.error.message, type="internal_server_error")
                    await response.write(sse.encode_event(err.body()))
                await response.write(sse.encode_event(gen.chunk([gen.stream_choice(sub, delta)])))
        if response is None:  # no output at all (cannot normally happen): still a valid stream
            response = await sse.open_stream(gen.request)
        if req.include_usage:
            final = gen.chunk([])
            final["usage"] = gen.usage()
            await response.write(sse.encode_event(final))
        await response.write(sse.DONE)
        await response.write_eof()
        return response
    except ClientConnectionResetError:
        gen.status = 499
        gen.error = "client disconnected"
        assert response is not None
        return response


def build_app(
    engine: EngineLike,
    *,
    api_key: str | None = None,
    max_waiting_requests: int = 256,
    telemetry: Telemetry | None = None,
    engine_thread: EngineThread | None = None,
) -> web.Application:
    """The served app; the engine loop starts with the app and stops with it.

    ``engine_thread``: the thread ``engine`` was built on, so its steps run there too (see
    `EngineThread`); without one the steps get a thread of their own.
    """
    metrics_ = ServerMetrics(engine.model_name)
    state = ServerState(
        engine=engine,
        async_engine=AsyncEngine(engine, observer=metrics_, thread=engine_thread),
        metrics=metrics_,
        telemetry=telemetry if telemetry is not None else Telemetry.from_env(),
        model_name=engine.model_name,
        max_model_len=engine.max_model_len,
        api_key=api_key or None,
        max_waiting_requests=max_waiting_requests,
    )
    state.idle.set()
    app = web.Application(middlewares=[error_middleware, auth_middleware])
    app[STATE] = state

    async def chat(request: web.Request) -> web.StreamResponse:
        return await _generate(request, "chat")

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _generate(request, "completion")

    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)

    async def on_startup(app: web.Application) -> None:
        app[STATE].async_engine.start()

    async def on_cleanup(app: web.Application) -> None:
        st = app[STATE]
        await asyncio.get_running_loop().run_in_executor(None, st.async_engine.stop)
        st.telemetry.shutdown()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


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
) -> None:
    """Run until SIGTERM/SIGINT (or `stop`), drain, then shut down.

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
    try:
        await stop.wait()
        inflight = app[STATE].inflight
        log.info("draining: waiting up to %.1fs for %d requests", grace_seconds, inflight)
        if not await drain(app, grace_seconds):
            log.warning("grace period over; cut off the requests still running")
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await runner.cleanup()
