"""The real server under load: concurrency, a tiny KV pool, disconnects, back-pressure, auth.

Every test ends by reading `/metrics` and checking no KV page is still held.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from jaeger import Jaeger, log_fields, tag
from live_server import LiveServer, make_engine

from mstar.engine.server.sse import parse_events
from mstar.engine.server.state import STATE
from mstar.engine.server.telemetry import REQUEST_SPAN_NAME, Telemetry

GREEDY_EXTRA = {"ignore_eos": True}
ENGINE_EVENTS = ("admit_refused", "evicted", "offloaded", "reloaded", "recomputed")
EVENT_METRIC = {
    "evicted": "mstar:evictions_total",
    "offloaded": "mstar:offloads_total",
    "reloaded": "mstar:reloads_total",
    "recomputed": "mstar:recomputations_total",
}


def prompt_for(i: int) -> list[int]:
    return [3 + i % 90, 3 + (i * 7) % 90, 3 + (i * 13) % 90]


def admit_failures(server: LiveServer) -> float:
    return sum(
        v for (name, _), v in server.metrics().items() if name == "mstar:admit_failures_total"
    )


async def stream_one(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int) -> str:
    stream = await client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body=GREEDY_EXTRA,
    )
    parts = []
    async for chunk in stream:
        parts.append(chunk.choices[0].text)
    return "".join(parts)


def run_streams(url: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        try:
            return await asyncio.gather(*(stream_one(client, p, max_tokens) for p in prompts))
        finally:
            await client.close()

    return asyncio.run(main())


def ids_of(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def test_32_concurrent_streams_are_correct_and_separate(server: LiveServer, reference: Any) -> None:
    prompts = [prompt_for(i) for i in range(32)]
    done_before = server.metric("mstar:request_success_total", finished_reason="length")
    tokens_before = server.metric("mstar:generation_tokens_total")
    texts = run_streams(server.url, prompts, 8)
    for prompt, text in zip(prompts, texts, strict=True):
        assert ids_of(text) == reference(prompt, 8)
    assert (
        server.metric("mstar:request_success_total", finished_reason="length") - done_before == 32
    )
    assert server.metric("mstar:generation_tokens_total") - tokens_before == 32 * 8
    assert server.metric("mstar:time_to_first_token_seconds_count") >= 32
    server.wait_metric("mstar:kv_cache_usage_perc", 0.0)
    server.wait_metric("mstar:num_requests_running", 0.0)


def test_tiny_kv_pool_traces_refusals_and_evictions(
    tiny_chat_dir: Path, reference: Any, jaeger: Jaeger
) -> None:
    """12 pages of 4 tokens for 8 requests needing ~6 pages each: refusals, offloads, reloads."""
    telemetry = Telemetry(service_name="mstar-tiny-pool", endpoint=jaeger.otlp_url + "/v1/traces")
    engine = make_engine(tiny_chat_dir, num_pages=12, max_num_seqs=8)
    with LiveServer(engine, telemetry=telemetry) as live:
        prompts = [prompt_for(i) for i in range(8)]
        texts = run_streams(live.url, prompts, 20)
        # Offloaded and reloaded KV gives exactly the tokens an uncontended run gives.
        for prompt, text in zip(prompts, texts, strict=True):
            assert ids_of(text) == reference(prompt, 20)
        # One more, continuing a caller's trace.
        status, _ = asyncio.run(_post_traced(live.url, prompt_for(8), TRACEPARENT))
        assert status == 200
        live.wait_metric("mstar:kv_cache_usage_perc", 0.0)
        live.wait_metric("mstar:host_kv_usage_perc", 0.0)
        assert live.app[STATE].telemetry.force_flush()
        traces = jaeger.wait_for("mstar-tiny-pool", lambda t: len(t) == 9)
        continued = [t for t in traces if t["traceID"] == PARENT_TRACE]
        assert len(continued) == 1
        root = next(s for s in continued[0]["spans"] if s["operationName"] == REQUEST_SPAN_NAME)
        assert root["references"][0]["spanID"] == PARENT_SPAN

        counts = dict.fromkeys(ENGINE_EVENTS, 0)
        for trace in traces:
            spans = trace["spans"]
            roots = [s for s in spans if s["operationName"] == REQUEST_SPAN_NAME]
            assert len(roots) == 1
            root = roots[0]
            assert tag(root, "span.kind") == "server"
            assert tag(root, "gen_ai.request.model") == "tiny"
            assert tag(root, "gen_ai.usage.completion_tokens") == 20
            assert tag(root, "gen_ai.usage.output_tokens") == 20
            assert tag(root, "gen_ai.usage.prompt_tokens") == tag(root, "gen_ai.usage.input_tokens")
            assert tag(root, "gen_ai.usage.input_tokens") == 3
            assert tag(root, "gen_ai.provider.name") == "mstar"
            assert tag(root, "gen_ai.response.id").startswith("cmpl-")
            assert tag(root, "gen_ai.latency.time_to_first_token") > 0
            children = {s["operationName"] for s in spans if s is not root}
            assert children == {"queue", "prefill", "decode"}
            for log in root["logs"]:
                fields = log_fields(log)
                counts[fields["event"]] += fields["mstar.count"]
                if fields["event"] == "admit_refused":
                    assert fields["reason"] in ("AllocationFailed", "RequestOffloading")
                    assert fields["resource"] == "kv"
                    assert fields["label"]  # the refusing stream, RequestOffloading's too
                    if fields["reason"] == "AllocationFailed":
                        assert fields["pages_short"] > 0
        assert counts["admit_refused"] > 0 and counts["evicted"] > 0
        assert counts["evicted"] == counts["offloaded"] + counts["recomputed"]
        # Every span event is one count in /metrics, and the other way round.
        assert admit_failures(live) == counts["admit_refused"]
        for event, metric in EVENT_METRIC.items():
            assert live.metric(metric) == counts[event], event


PARENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"


async def _post_traced(url: str, prompt: list[int], traceparent: str) -> tuple[int, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0}
    body["ignore_eos"] = True
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url + "/v1/completions", json=body, headers={"traceparent": traceparent}
        ) as resp,
    ):
        return resp.status, await resp.json()


async def _read_some_then_drop(url: str, max_tokens: int, chunks: int) -> int:
    body = {
        "model": "tiny",
        "prompt": "w7 w8",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    seen = 0
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data:"):
                seen += 1
            if seen >= chunks:
                break
        # Leaving the block without reading the rest closes the connection mid-stream.
    return seen


def test_disconnect_mid_stream_aborts_and_frees_pages(server: LiveServer) -> None:
    aborted = server.metric("mstar:request_success_total", finished_reason="abort")
    tokens = server.metric("mstar:generation_tokens_total")
    assert asyncio.run(_read_some_then_drop(server.url, 400, 3)) == 3
    server.wait_metric("mstar:request_success_total", aborted + 1, finished_reason="abort")
    server.wait_metric("mstar:kv_cache_usage_perc", 0.0)
    server.wait_metric("mstar:num_requests_running", 0.0)
    assert server.metric("mstar:generation_tokens_total") - tokens < 400  # it stopped early


async def _flood(url: str, n: int) -> list[tuple[int, dict[str, Any], dict[str, str]]]:
    body = {"model": "tiny", "prompt": "w7 w8", "max_tokens": 30, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:

        async def one() -> tuple[int, dict[str, Any], dict[str, str]]:
            async with session.post(url + "/v1/completions", json=body) as resp:
                return resp.status, await resp.json(), dict(resp.headers)

        return await asyncio.gather(*(one() for _ in range(n)))


def test_full_waiting_queue_answers_429(tiny_chat_dir: Path) -> None:
    engine = make_engine(tiny_chat_dir, max_num_seqs=1)
    with LiveServer(engine, max_waiting_requests=2) as live:
        results = asyncio.run(_flood(live.url, 10))
        statuses = sorted(r[0] for r in results)
        # Refused requests never reached the engine: only the served ones are counted.
        served = statuses.count(200)
        assert live.metric("mstar:request_success_total", finished_reason="length") == served
        assert live.metric("mstar:request_success_total", finished_reason="abort") == 0
        assert 429 in statuses and 200 in statuses
        assert set(statuses) == {200, 429}
        for status, body, headers in results:
            if status == 429:
                assert headers["Retry-After"] == "1"
                assert body["error"]["code"] == "rate_limit_exceeded"
                assert body["error"]["type"] == "rate_limit_error"
            else:
                assert body["usage"]["completion_tokens"] == 30
        live.wait_metric("mstar:kv_cache_usage_perc", 0.0)
        live.wait_metric("mstar:num_requests_waiting", 0.0)


def test_api_key_guards_v1_only(tiny_chat_dir: Path) -> None:
    with LiveServer(make_engine(tiny_chat_dir), api_key="sekret") as live:

        async def probe() -> list[tuple[int, Any]]:
            out = []
            async with aiohttp.ClientSession() as session:
                for path, headers in (
                    ("/v1/models", {}),
                    ("/v1/models", {"Authorization": "Bearer wrong"}),
                    ("/v1/models", {"Authorization": "Bearer sekret"}),
                    ("/health", {}),
                    ("/ready", {}),
                    ("/metrics", {}),
                ):
                    async with session.get(live.url + path, headers=headers) as resp:
                        text = await resp.text()
                        out.append((resp.status, text))
            return out

        results = asyncio.run(probe())
        assert [s for s, _ in results] == [401, 401, 200, 200, 200, 200]
        assert json.loads(results[0][1])["error"]["code"] == "invalid_api_key"
        bad = openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="tiny", prompt="w7", max_tokens=2)
        good = openai.OpenAI(base_url=live.url + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="w7", max_tokens=2).choices
        live.wait_metric("mstar:kv_cache_usage_perc", 0.0)


def test_raw_sse_shape(server: LiveServer) -> None:
    async def fetch() -> str:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "w9"}],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        async with (
            aiohttp.ClientSession() as session,
            session.post(server.url + "/v1/chat/completions", json=body) as resp,
        ):
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            return await resp.text()

    events = parse_events(asyncio.run(fetch()))
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert isinstance(usage, dict) and usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 3
    chunks = [e for e in events[:-2] if isinstance(e, dict)]
    assert all(c["usage"] is None for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_cuts_off_in_flight_requests_and_leaves_the_engine_empty(tiny_chat_dir: Path) -> None:
    """The drain path (as on SIGTERM) with a short grace: the request ends "abort", no page held."""
    engine = make_engine(tiny_chat_dir, max_model_len=512)
    live = LiveServer(engine, grace_seconds=0.2).start()
    result: dict[str, Any] = {}

    async def long_request() -> None:
        body = {"model": "tiny", "prompt": "w7", "max_tokens": 500, "ignore_eos": True}
        async with (
            aiohttp.ClientSession() as session,
            session.post(live.url + "/v1/completions", json=body) as resp,
        ):
            result["status"], result["body"] = resp.status, await resp.json()

    async def main() -> None:
        task = asyncio.create_task(long_request())
        while live.metric("mstar:num_requests_running") != 1.0:
            await asyncio.sleep(0.02)
        await asyncio.get_running_loop().run_in_executor(None, live.stop)
        await task

    asyncio.run(main())
    assert result["status"] == 200
    assert result["body"]["choices"][0]["finish_reason"] == "abort"
    assert 0 < result["body"]["usage"]["completion_tokens"] < 500
    stats = engine.stats()
    assert (stats.kv_usage, stats.num_running, stats.num_waiting) == (0.0, 0, 0)
    assert not engine.has_unfinished_requests()
