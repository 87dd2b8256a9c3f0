"""How the server answers an engine that refused a request's batch at submit."""

from __future__ import annotations

from mstar.engine.sampling_params import InvalidParameter
from mstar.engine.server.async_engine import EngineDeadError
from mstar.engine.server.errors import APIError
from mstar.engine.server.protocol import GenerationRequest

#: How a refused `add_requests` answers, first matching row wins: (exception, HTTP status,
#: OpenAI error type, message prefix). The engine has undone the whole batch in every case.
SUBMIT_ERRORS: tuple[tuple[type[Exception], int, str, str], ...] = (
    (InvalidParameter, 400, "invalid_request_error", ""),
    (EngineDeadError, 503, "service_unavailable", ""),
    (ValueError, 400, "invalid_request_error", ""),
    (Exception, 500, "internal_server_error", "the engine refused the request: "),
)


def submit_error(exc: Exception, req: GenerationRequest) -> APIError:
    """The client's answer to an engine that refused the request's batch (`SUBMIT_ERRORS`)."""
    status, kind, prefix = next((s, k, p) for c, s, k, p in SUBMIT_ERRORS if isinstance(exc, c))
    param = None
    if isinstance(exc, InvalidParameter):
        # The engine names its own parameters; the route may call them otherwise.
        names = {"prompt": req.prompt_param, "max_tokens": req.max_tokens_param}
        param = names.get(exc.param, exc.param)
    return APIError(status, prefix + str(exc), type=kind, param=param)
