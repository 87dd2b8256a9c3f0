"""Server-sent events as OpenAI streams them: `data: <json>` blocks, then `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # Keeps reverse proxies (nginx) from buffering the stream into one late burst.
    "X-Accel-Buffering": "no",
}


def encode_event(payload: dict[str, Any]) -> bytes:
    """One SSE event; compact JSON has no newline, so one `data:` line suffices."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def open_stream(request: web.Request) -> web.StreamResponse:
    """Send the status line and headers of a 200 event stream."""
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    response.enable_chunked_encoding()
    await response.prepare(request)
    return response


def parse_events(text: str) -> list[dict[str, Any] | str]:
    """Decode a complete SSE body back into payloads (`"[DONE]"` stays a string).

    The inverse of `encode_event`, for clients and tests that read raw streams.
    """
    events: list[dict[str, Any] | str] = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        data = [line[5:].lstrip() for line in block.split("\n") if line.startswith("data:")]
        if not data:
            continue
        joined = "\n".join(data)
        events.append(joined if joined == "[DONE]" else json.loads(joined))
    return events
