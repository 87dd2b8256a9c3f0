"""Reading a request's JSON body: everything that can go wrong before the bytes are a checked
JSON value (unreadable bytes, a bad charset, bad JSON, too deep nesting, invalid Unicode) is a
400.

Shared by the generation routes (`lifecycle`), the tokenizer routes (`tokenize`) and the LoRA
admin routes (`lora_routes`).
"""

from __future__ import annotations

import codecs
import json
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from mstar.engine.server.errors import bad_request

#: Deepest JSON nesting a body may have. OpenAI bodies are a few levels deep; the bound makes a
#: hostile body fail the same way whatever the interpreter's recursion limit is.
MAX_JSON_DEPTH = 64


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


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode_json_body(raw: bytes, charset: str | None) -> Any:
    """Bytes of a request body -> JSON value; every way it can be malformed is a 400.

    The one gate for bodies: an unknown or non-text charset, bytes that are not in it, JSON
    that does not parse (NaN, integers past Python's digit limit, nesting past
    `MAX_JSON_DEPTH` or the recursion limit) and strings that are not valid Unicode (lone
    UTF-16 surrogates such as a "\\ud800" escape, which no tokenizer can take) all end here.
    """
    encoding = charset or "utf-8"
    try:
        text = raw.decode(codecs.lookup(encoding).name)
    except (LookupError, ValueError) as exc:  # unknown, not a text codec, or undecodable bytes
        raise bad_request(f"Cannot decode the body as {encoding!r}: {exc}") from exc
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError as exc:
        raise bad_request(f"Invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels") from exc
    except ValueError as exc:  # JSONDecodeError, too many digits, NaN / Infinity
        raise bad_request(f"Invalid JSON body: {exc}") from exc
    _check_values(body)
    return body


def _valid_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_values(body: Any) -> None:
    """Walk the parsed body (iteratively) for nesting depth and invalid strings.

    A failure names the top-level field it sits under, which is the request parameter.
    """
    stack: list[tuple[Any, int, str | None]] = [(body, 1, None)]
    while stack:
        value, depth, param = stack.pop()
        if isinstance(value, str):
            if not _valid_unicode(value):
                where = f"'{param}'" if param else "The body"
                raise bad_request(
                    f"{where} contains a lone UTF-16 surrogate, which is not valid Unicode.",
                    param,
                )
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad_request(
                f"Invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels", param
            )
        if isinstance(value, list):
            stack.extend((item, depth + 1, param) for item in value)
            continue
        for key, item in value.items():
            if not _valid_unicode(key):
                raise bad_request("A key of the body is not valid Unicode (lone surrogate).", param)
            stack.append((item, depth + 1, key if depth == 1 else param))
