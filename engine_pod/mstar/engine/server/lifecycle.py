"""The life of one completion / chat request, from its body to the last engine output.

One HTTP request fans out to `len(prompts) * n` engine requests. Each has a `ChoiceState`
turning its tokens into text; stop strings end a choice here (then the engine request is
aborted). Whatever ends a handler (success, error, client disconnect, cancellation) runs the
same `finally`: every engine request not yet finished is aborted, so its pages are freed, and
each choice is counted once in the metrics and traced once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from mstar.engine.model.tokenizer import IncrementalDetokenizer
from mstar.engine.outputs import (
    ErrorKind,
    FinishReason,
    RequestError,
    RequestOutput,
    TokenLogprob,
)
from mstar.engine.resources.sampling.grammar import InvalidGrammar
from mstar.engine.sampling_params import GrammarSpec
from mstar.engine.server.async_engine import NewRequest
from mstar.engine.server.body import read_json_body
from mstar.engine.server.choice import ChoiceState, Delta
from mstar.engine.server.errors import APIError, bad_request
from mstar.engine.server.limits import RETRY_AFTER_SECONDS, Deadline
from mstar.engine.server.lora_routes import resolve_model
from mstar.engine.server.protocol import (
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
)
from mstar.engine.server.responses import complete, stream
from mstar.engine.server.state import STATE
from mstar.engine.server.submit_errors import submit_error
from mstar.engine.server.tools import reported_reason, template_messages


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
    #: The prompt's scores (`SamplingParams.prompt_logprobs`), once the engine sent them.
    prompt_logprobs: list[TokenLogprob] | None = None


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
        #: the LoRA adapter the request's `model` names (None: the base model)
        self.lora_name: str | None = None
        self.prompt_texts: list[str] = []
        self.status = 200
        self.error: str | None = None
        self.deadline = Deadline(self.arrival, self.state.request_timeout)
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
        self.deadline.shorten(body)
        req = parse_chat_request(body) if self.kind == "chat" else parse_completion_request(body)
        self.lora_name = resolve_model(self.state, req.model)
        self.req = req
        p = req.params
        self.trace.span.set_attributes(
            {
                "gen_ai.request.model": req.model or self.state.model_name,
                "gen_ai.response.model": self.response_model(),
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
        if p.grammar is not None:
            await self._check_grammar(req, p.grammar)
        return req

    async def _check_grammar(self, req: GenerationRequest, grammar: GrammarSpec) -> None:
        """Compile the request's grammar off the event loop: a bad schema is a 400 before the
        engine sees the request (which then finds it in the compiler's cache)."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.state.engine.grammar.compile, grammar)
        except InvalidGrammar as exc:
            param = "tools" if req.tools is not None and req.tools.forced else "response_format"
            raise bad_request(f"Invalid '{param}' schema: {exc}", param) from exc

    def tokenize(self, req: GenerationRequest) -> list[list[int]]:
        tok = self.state.engine.tokenizer
        if req.kind == "chat":
            tools = req.tools.prompt_tools() if req.tools is not None else None
            native = "tools" in (getattr(tok, "chat_template", None) or "")
            messages = template_messages(req.messages, tools, native)
            extra = {"tools": tools} if tools and native else {}
            try:
                text = tok.apply_chat_template(messages, add_generation_prompt=True, **extra)
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
                params.lora_name = self.lora_name
                rid = f"{self.id}-{index}"
                detok = IncrementalDetokenizer(
                    tok, ids, skip_special_tokens=req.skip_special_tokens
                )
                choice = ChoiceState(
                    index,
                    detok,
                    stop=req.stop,
                    include_stop_str_in_output=req.include_stop_str_in_output,
                    min_tokens=params.min_tokens,
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
        if not state.admission.has_room(len(new)):
            raise state.admission.refuse()
        try:
            async with asyncio.timeout_at(self.deadline.at):
                await state.async_engine.add_requests(new)
        except BaseException as exc:
            for sub in self.subs:
                sub.done = True  # add_requests undid the whole batch (refused or cancelled)
            if isinstance(exc, TimeoutError):
                self.deadline.passed = True
                raise self.deadline.error() from exc
            if isinstance(exc, Exception):
                raise submit_error(exc, req) from exc
            raise
        for sub in self.subs:
            sub.submitted = True

    # -- consuming outputs ---------------------------------------------------------------------

    async def next_deltas(self) -> list[tuple[SubRequest, Delta]]:
        """Wait for engine output; return what can be shown now (may be empty). Past the
        deadline, every unfinished choice ends with an error (its engine request aborted)."""
        try:
            async with asyncio.timeout_at(self.deadline.at):
                position, out = await self.queue.get()
        except TimeoutError:
            return self._expire()
        ready = [self._absorb(position, out)]
        while not self.queue.empty():  # whatever else the same step delivered
            position, out = self.queue.get_nowait()
            ready.append(self._absorb(position, out))
        return [(sub, d) for sub, d in ready if d is not None]

    def _expire(self) -> list[tuple[SubRequest, Delta]]:
        self.deadline.passed = True
        error = RequestError(ErrorKind.INTERNAL, self.deadline.error().message)
        now = time.monotonic()
        ready = []
        for position, sub in enumerate(self.subs):
            if sub.done:
                continue
            self.state.async_engine.abort_request(sub.request_id)
            last = sub.last or RequestOutput(sub.request_id, [], None, False, arrival_time=now)
            out = dataclasses.replace(
                last,
                new_token_ids=[],
                new_logprobs=None,
                events=[],
                finished=True,
                finish_reason=FinishReason.ERROR,
                error=error,
                finished_time=now,
            )
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
        if out.prompt_logprobs is not None:
            sub.prompt_logprobs = out.prompt_logprobs
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
        reason = reported_reason(self.req.tools if self.req else None, sub.choice.text, reason)
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
        if self.deadline.passed:
            return self.deadline.error()
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

    def response_model(self) -> str:
        """The ``model`` a response names: the adapter the request asked for (as vLLM does),
        else the base model."""
        return self.lora_name or self.state.model_name

    def prompt_tokens(self) -> int:
        seen: dict[int, int] = {}
        for s in self.subs:
            seen[s.prompt_index] = len(s.prompt_ids)
        return sum(seen.values())

    def usage(self) -> dict[str, Any]:
        prompt = self.prompt_tokens()
        completion = sum(s.choice.num_tokens for s in self.subs)
        cached: dict[int, int] = {}
        for s in self.subs:  # the most of a prompt's tokens that any of its choices found cached
            if s.last is not None:
                cached[s.prompt_index] = max(
                    cached.get(s.prompt_index, 0), s.last.num_cached_tokens
                )
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
        }


def _encode(tok: Any, text: str, param: str) -> list[int]:
    """Tokenize prompt text; text the tokenizer cannot take is the request's fault (400).

    A completion prompt gets the tokenizer's own special tokens (Gemma's BOS, as vLLM and
    transformers add it); a chat prompt's template writes its own."""
    try:
        return list(tok.encode(text, add_special_tokens=param == "prompt"))
    except Exception as exc:
        raise bad_request(f"Cannot tokenize the {param}: {exc}", param) from exc


async def generate(request: web.Request, kind: str) -> web.StreamResponse:
    """The handler of both generation routes: parse, tokenize, submit, answer, clean up."""
    state = request.app[STATE]
    state.last_arrival = time.monotonic()
    if state.draining:  # a router that has not let go yet: send it elsewhere
        raise APIError(
            503,
            "The server is shutting down; retry on another replica.",
            type="service_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    if not await state.admission.wait_for_room():  # before the body is even read (`limits`)
        raise state.admission.refuse()
    state.enter()
    gen = Generation(request, kind)
    state.generations.add(gen)
    try:
        try:  # reading the body, compiling a grammar: bounded by the server's deadline too
            async with asyncio.timeout_at(gen.deadline.at):
                req = await gen.parse()
        except TimeoutError as exc:
            raise gen.deadline.error() from exc
        prompts = gen.tokenize(req)
        new = gen.plan(req, prompts)
        await gen.submit(req, new)
        if req.stream:
            return await stream(gen, req)
        return await complete(gen, req)
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
