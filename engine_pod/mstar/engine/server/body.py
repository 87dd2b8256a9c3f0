"""Reading a request's JSON body: everything that can go wrong before the bytes are JSON is a 400.

Shared by the generation routes (`lifecycle`) and the tokenizer routes (`tokenize`).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from mstar.engine.server.protocol import bad_request, decode_json_body


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
