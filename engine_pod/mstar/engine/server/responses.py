"""OpenAI response shaping: a whole JSON body, or server-sent events, from a `Generation`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError

from mstar.engine.server import sse
from mstar.engine.server.choice import Delta, chat_logprobs, completion_logprobs
from mstar.engine.server.errors import APIError
from mstar.engine.server.protocol import GenerationRequest
from mstar.engine.server.scoring import echo_logprobs, join_echo, vllm_prompt_logprobs
from mstar.engine.server.tools import ToolStream, parse_output

if TYPE_CHECKING:
    from mstar.engine.server.lifecycle import Generation, SubRequest


def logprobs_body(gen: Generation, delta: Delta) -> dict[str, Any] | None:
    """A delta's logprobs in the route's shape, or None when none were asked for."""
    req = gen.req
    assert req is not None
    if req.top_logprobs is None:
        return None
    tok = gen.state.engine.tokenizer
    if req.kind == "chat":
        return chat_logprobs(tok, delta.pieces, req.top_logprobs)
    return completion_logprobs(tok, delta.pieces, 0)


def chunk(gen: Generation, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """One streamed event's body around ``choices``."""
    assert gen.req is not None
    body: dict[str, Any] = {
        "id": gen.id,
        "object": "chat.completion.chunk" if gen.kind == "chat" else "text_completion",
        "created": gen.created,
        "model": gen.response_model(),
        "choices": choices,
    }
    if gen.req.include_usage:
        body["usage"] = None
    return body


def stream_choices(
    gen: Generation,
    sub: SubRequest,
    delta: Delta,
    tools: ToolStream | None,
    started: set[int] | None = None,
) -> list[dict[str, Any]]:
    """The streamed choice entries for one delta: one, or with tools one per tool delta.
    ``started``: the completion choices that sent an event already; a choice's first event
    starts with its prompt when `echo` (and its scores, as vLLM streams them)."""
    lp = logprobs_body(gen, delta)
    req = gen.req
    assert req is not None
    if gen.kind != "chat":
        entry = _completion_choice(sub, delta, lp)
        if started is None or sub.index in started:
            return [entry]
        started.add(sub.index)
        if req.echo:
            echo = _echo(gen, sub)
            if lp is None and req.top_logprobs is not None:
                lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            entry["text"] = echo + delta.text
            entry["logprobs"] = _scored(gen, sub, lp, echo)
        if req.vllm_prompt_logprobs:
            entry["prompt_logprobs"] = _vllm_scores(gen, sub)
        return [entry]
    reason = delta.finish_reason
    if tools is None:
        bodies: list[dict[str, Any]] = [{"content": delta.text} if delta.text else {}]
    else:
        bodies = tools.feed(delta.text)
        if reason is not None:
            last, reason = tools.end(reason)
            bodies += last
        if not bodies and reason is None and lp is None:
            return []  # held back (a tool call may be starting)
        bodies = bodies or [{}]
    out = [
        {"index": sub.index, "delta": body, "logprobs": None, "finish_reason": None}
        for body in bodies
    ]
    out[0]["logprobs"] = lp
    out[-1]["finish_reason"] = reason  # type: ignore[assignment]
    return out


def _completion_choice(sub: SubRequest, delta: Delta, lp: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "index": sub.index,
        "text": delta.text,
        "logprobs": lp,
        "finish_reason": delta.finish_reason,
    }


def _echo(gen: Generation, sub: SubRequest) -> str:
    """The prompt as a completion's `echo` repeats it: its text, else its decoded ids."""
    return gen.prompt_texts[sub.prompt_index] or gen.state.engine.tokenizer.decode(sub.prompt_ids)


def _scored(gen: Generation, sub: SubRequest, lp: dict[str, Any] | None, echo: str) -> Any:
    """A completion choice's `logprobs` with the echoed prompt's scores in front (OpenAI's
    echo with logprobs), or as they were."""
    req = gen.req
    assert req is not None
    if lp is None or not req.echo or sub.prompt_logprobs is None:
        return lp
    tok = gen.state.engine.tokenizer
    prompt = echo_logprobs(tok, sub.prompt_ids, sub.prompt_logprobs, req.top_logprobs or 0)
    return join_echo(prompt, lp, len(echo))


def _vllm_scores(gen: Generation, sub: SubRequest) -> list[Any] | None:
    """vLLM's `prompt_logprobs` of a choice's prompt, when the request asked in its words."""
    assert gen.req is not None
    if not gen.req.vllm_prompt_logprobs or sub.prompt_logprobs is None:
        return None
    return vllm_prompt_logprobs(gen.state.engine.tokenizer, sub.prompt_ids, sub.prompt_logprobs)


async def complete(gen: Generation, req: GenerationRequest) -> web.Response:
    """Wait for every choice, then answer one JSON body."""
    texts: dict[int, list[str]] = {s.index: [] for s in gen.subs}
    logprobs: dict[int, list[dict[str, Any]]] = {s.index: [] for s in gen.subs}
    while gen.pending():
        for sub, delta in await gen.next_deltas():
            texts[sub.index].append(delta.text)
            lp = logprobs_body(gen, delta)
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
            message: dict[str, Any] = {"role": "assistant", "content": text}
            reason = sub.choice.finish_reason
            if req.tools is not None:
                message["content"], calls = parse_output(req.tools, text)
                if calls:
                    message["tool_calls"] = calls
                    reason = "tool_calls" if reason == "stop" else reason
            choices.append(
                {"index": sub.index, "message": message, "logprobs": lp, "finish_reason": reason}
            )
        else:
            echo = _echo(gen, sub) if req.echo else ""
            entry = {
                "index": sub.index,
                "text": echo + text,
                "logprobs": _scored(gen, sub, lp, echo),
                "finish_reason": sub.choice.finish_reason,
            }
            if req.vllm_prompt_logprobs:
                entry["prompt_logprobs"] = _vllm_scores(gen, sub)
            choices.append(entry)
    body: dict[str, Any] = {
        "id": gen.id,
        "object": "chat.completion" if req.kind == "chat" else "text_completion",
        "created": gen.created,
        "model": gen.response_model(),
        "choices": choices,
        "usage": gen.usage(),
    }
    if req.kind == "chat" and req.vllm_prompt_logprobs:  # one prompt: on the response (vLLM)
        body["prompt_logprobs"] = _vllm_scores(gen, gen.subs[0])
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


async def stream(gen: Generation, req: GenerationRequest) -> web.StreamResponse:
    """Answer server-sent events as choices produce text; usage and [DONE] last."""
    response: web.StreamResponse | None = None
    tools: dict[int, ToolStream] = {}
    started: set[int] = set()
    if req.tools is not None:
        tools = {s.index: ToolStream(req.tools) for s in gen.subs}
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
                    await response.write(sse.encode_event(chunk(gen, role)))
            for sub, delta in deltas:
                if sub.error is not None and delta.finish_reason is not None:
                    err = APIError(500, sub.error.message, type="internal_server_error")
                    await response.write(sse.encode_event(err.body()))
                for entry in stream_choices(gen, sub, delta, tools.get(sub.index), started):
                    await response.write(sse.encode_event(chunk(gen, [entry])))
        if response is None:  # no output at all (cannot normally happen): still a valid stream
            response = await sse.open_stream(gen.request)
        if req.include_usage:
            final = chunk(gen, [])
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
