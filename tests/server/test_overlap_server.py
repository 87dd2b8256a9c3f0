"""The overlap loop behind the real server: streamed text, stop strings, stop ids, max tokens and
usage are those of the synchronous loop offline, concurrent streams included; a client that
drops mid-stream frees every page although its next token was already being computed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from live_server import LiveServer, make_engine

from mstar.engine.sampling_params import SamplingParams

PROMPTS = [[7, 8, 9], [12, 13], [30, 31, 32, 33, 34], [5]]
NEW = 12


@pytest.fixture(scope="module")
def live(tiny_chat_dir: Path) -> Iterator[LiveServer]:
    engine = make_engine(tiny_chat_dir, async_scheduling="on")
    assert engine.overlap is not None
    with LiveServer(engine) as server:
        yield server


@pytest.fixture(scope="module")
def sync_reference(tiny_chat_dir: Path) -> list[list[int]]:
    engine = make_engine(tiny_chat_dir, async_scheduling="off")
    assert engine.overlap is None
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    return engine.generate(PROMPTS, params)


def _words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict:
    """One streamed completion: its text, finish reason and usage."""
    text, reason, usage = "", None, None
    body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True}, **body}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                text += c["text"]
                reason = c.get("finish_reason") or reason
            usage = chunk.get("usage") or usage
    return {"text": text, "reason": reason, "usage": usage}


def test_concurrent_streams_match_the_sync_loop(
    live: LiveServer, sync_reference: list[list[int]]
) -> None:
    """Stop strings, stop ids and max tokens at once on four concurrent streams."""
    bodies, expected = [], []
    for i, (prompt, ref) in enumerate(zip(PROMPTS, sync_reference, strict=True)):
        body: dict[str, Any] = {"prompt": _words(prompt), "temperature": 0, "ignore_eos": True}
        stop_at = next((j for j in range(2, NEW) if ref[j] not in ref[:j]), NEW - 1)
        if i == 0:  # a stop string: cut before it, counted in usage
            body.update(max_tokens=NEW, stop=[f"w{ref[stop_at]}"])
            expected.append((_words(ref[:stop_at]), "stop", stop_at + 1))
        elif i == 1:  # a stop id: its own text is shown (not a stop string)
            body.update(max_tokens=NEW, stop_token_ids=[ref[stop_at]])
            expected.append((_words(ref[: stop_at + 1]), "stop", stop_at + 1))
        else:  # max tokens, short and long
            n = 3 if i == 2 else NEW
            body.update(max_tokens=n)
            expected.append((_words(ref[:n]), "length", n))
        bodies.append(body)

    async def run() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(_stream(session, live.url, b) for b in bodies))

    for got, (text, reason, n) in zip(asyncio.run(run()), expected, strict=True):
        assert got["text"].split() == text.split()
        assert got["reason"] == reason
        assert got["usage"]["completion_tokens"] == n
    live.wait_metric("mstar:num_requests_running", 0.0)
    live.engine.kv.assert_pages_conserved()


def test_dropped_stream_frees_everything(live: LiveServer) -> None:
    async def read_some_then_drop() -> int:
        body = {"model": "tiny", "prompt": "w9 w10", "max_tokens": 300, "ignore_eos": True}
        seen = 0
        async with (
            aiohttp.ClientSession() as session,
            session.post(live.url + "/v1/completions", json={**body, "stream": True}) as r,
        ):
            async for raw in r.content:
                seen += raw.startswith(b"data: {")
                if seen == 4:
                    break
        return seen

    aborted = live.metric("mstar:request_success_total", finished_reason="abort")
    assert asyncio.run(read_some_then_drop()) == 4
    live.wait_metric("mstar:request_success_total", aborted + 1, finished_reason="abort")
    live.wait_metric("mstar:kv_cache_usage_perc", 0.0)
    live.wait_metric("mstar:num_requests_running", 0.0)
    assert not live.engine.has_unfinished_requests()
    live.engine.kv.wait_copies()
    live.engine.kv.assert_pages_conserved()
