"""The submit error table: each way the engine refuses a request's batch, as the client sees it."""

from __future__ import annotations

import pytest

from mstar.engine.sampling_params import InvalidParameter
from mstar.engine.server.async_engine import EngineDeadError
from mstar.engine.server.protocol import (
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
)
from mstar.engine.server.submit_errors import submit_error

COMPLETION = parse_completion_request({"prompt": "hi"})
CHAT = parse_chat_request({"messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize(
    ("exc", "status", "kind", "message"),
    [
        (InvalidParameter("seed", "seed is out of range"), 400, "invalid_request_error", None),
        (EngineDeadError("the engine loop died"), 503, "service_unavailable", None),
        (ValueError("request id in use"), 400, "invalid_request_error", None),
        (
            KeyError("boom"),
            500,
            "internal_server_error",
            "the engine refused the request: 'boom'",
        ),
    ],
)
def test_each_refusal_has_its_status_and_type(
    exc: Exception, status: int, kind: str, message: str | None
) -> None:
    err = submit_error(exc, COMPLETION)
    assert (err.status, err.type) == (status, kind)
    assert err.message == (message or str(exc))
    assert err.param == (exc.param if isinstance(exc, InvalidParameter) else None)


@pytest.mark.parametrize(
    ("req", "engine_param", "shown"),
    [
        (COMPLETION, "prompt", "prompt"),
        (CHAT, "prompt", "messages"),
        (CHAT, "max_tokens", "max_completion_tokens"),
        (COMPLETION, "temperature", "temperature"),
    ],
)
def test_an_invalid_parameter_is_named_as_the_route_calls_it(
    req: GenerationRequest, engine_param: str, shown: str
) -> None:
    err = submit_error(InvalidParameter(engine_param, "out of range"), req)
    assert err.param == shown
