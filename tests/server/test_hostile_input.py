"""Hostile requests against the real server: each class that used to answer 500 is now a 400
(401 for the Authorization header) in OpenAI's error shape, and the server holds nothing after.

Raw `http.client`, because no well-behaved client sends these bytes.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import LiveServer, make_engine

JSON_TYPE = {"Content-Type": "application/json"}
DEEP = 50_000


def send(
    live: LiveServer, method: str, path: str, body: bytes | None, headers: dict[str, bytes | str]
) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    try:
        conn.putrequest(method, path)
        for name, value in headers.items():
            conn.putheader(name, value)  # bytes go out as they are
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def check_error(status: int, payload: dict[str, object], expected: int, param: str | None) -> str:
    assert status == expected, payload
    err = payload["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    return str(err["message"])


HOSTILE: list[tuple[str, str, bytes, dict[str, bytes | str], str | None, str]] = [
    # 1. nesting far past the recursion limit, on either route
    (
        "nested-arrays",
        "/v1/completions",
        b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}",
        JSON_TYPE,
        None,
        "nested deeper",
    ),
    (
        "nested-objects",
        "/v1/chat/completions",
        b'{"messages": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}",
        JSON_TYPE,
        None,
        "nested deeper",
    ),
    # 2. an integer past Python's int-from-string digit limit
    (
        "huge-int",
        "/v1/completions",
        b'{"prompt": "w1", "max_tokens": ' + b"9" * 5000 + b"}",
        JSON_TYPE,
        None,
        "digits",
    ),
    # 3. a charset that is unknown, or not ASCII at all
    (
        "unknown-charset",
        "/v1/completions",
        b'{"prompt": "w1"}',
        {"Content-Type": "application/json; charset=nope"},
        None,
        "unknown encoding",
    ),
    (
        "non-ascii-charset",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "w1"}]}',
        {"Content-Type": b"application/json; charset=\xe9\xff"},
        None,
        "Cannot decode the body",
    ),
    # 4. Content-Encoding: gzip on bytes that are not gzip
    (
        "fake-gzip",
        "/v1/completions",
        b'{"prompt": "w1"}',
        {**JSON_TYPE, "Content-Encoding": "gzip"},
        None,
        "content-encoding",
    ),
    # 5. lone UTF-16 surrogates: a prompt, a prompt list, message content
    (
        "surrogate-prompt",
        "/v1/completions",
        b'{"prompt": "w1 \\ud800"}',
        JSON_TYPE,
        "prompt",
        "surrogate",
    ),
    (
        "surrogate-prompt-list",
        "/v1/completions",
        b'{"prompt": ["w1", "w2 \\udfff"]}',
        JSON_TYPE,
        "prompt",
        "surrogate",
    ),
    (
        "surrogate-message",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
        JSON_TYPE,
        "messages",
        "surrogate",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "param", "says"),
    [case[1:] for case in HOSTILE],
    ids=[case[0] for case in HOSTILE],
)
def test_malformed_bodies_are_400(
    server: LiveServer,
    path: str,
    body: bytes,
    headers: dict[str, bytes | str],
    param: str | None,
    says: str,
) -> None:
    served = server.metric("mstar:prompt_tokens_total")
    status, payload = send(server, "POST", path, body, headers)
    assert says in check_error(status, payload, 400, param)
    # Refused at the gate: the engine never saw it, the server is still up and holds nothing.
    assert server.metric("mstar:prompt_tokens_total") == served
    assert server.get("/health")[0] == 200
    server.wait_metric("mstar:kv_cache_usage_perc", 0.0)


@pytest.fixture(scope="module")
def guarded(tiny_chat_dir: Path) -> Iterator[LiveServer]:
    with LiveServer(make_engine(tiny_chat_dir), api_key="sekret") as live:
        yield live


@pytest.mark.parametrize(
    "authorization",
    [b"Bearer \xff\xfe", b"Bearer s\xe9kret", b"\xc3(", b"Bearer sekret\x80"],
    ids=["invalid-utf8", "latin-1", "no-scheme", "key-then-junk"],
)
def test_malformed_authorization_header_is_401(guarded: LiveServer, authorization: bytes) -> None:
    status, payload = send(guarded, "GET", "/v1/models", None, {"Authorization": authorization})
    assert status == 401
    err = payload["error"]
    assert isinstance(err, dict) and err["code"] == "invalid_api_key"
    status, payload = send(guarded, "GET", "/v1/models", None, {"Authorization": "Bearer sekret"})
    assert status == 200 and payload["object"] == "list"


def test_an_unreadable_body_leaves_one_log_line_and_no_traceback(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The 400 for bytes that are not the gzip they claim; aiohttp's later re-read of the body
    used to log `ERROR aiohttp.server: Unhandled exception` with a RequestPayloadError trace."""
    body = b'{"prompt": "w1"}'
    with caplog.at_level(logging.DEBUG, logger="aiohttp"):
        status, payload = send(
            server, "POST", "/v1/completions", body, {**JSON_TYPE, "Content-Encoding": "gzip"}
        )
        assert "content-encoding" in check_error(status, payload, 400, None)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not _body_lines(caplog):
            time.sleep(0.05)
    lines = _body_lines(caplog)
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "unreadable request body" in lines[0].getMessage()
    assert "gzip" in lines[0].getMessage() and "\n" not in lines[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def _body_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "aiohttp.server" and "body" in r.getMessage()]
