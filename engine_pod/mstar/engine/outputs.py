"""What the engine hands back each step: per-request token deltas, lifecycle times and events.

The server turns these into HTTP responses, metrics and span events; the engine never calls
telemetry itself, so observation cannot steer it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class FinishReason(enum.StrEnum):
    """Why a request ended; the values are OpenAI's `finish_reason` strings."""

    STOP = "stop"  # EOS or a stop token (stop strings are the server's)
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # the caller aborted it (disconnect, shutdown)
    ERROR = "error"  # see `RequestOutput.error`
    #: The request's grammar allows no token (e.g. the vocabulary cannot spell what it needs).
    GRAMMAR_DEAD_END = "grammar_dead_end"
    #: The server's only: the choice's output was parsed into tool calls.
    TOOL_CALLS = "tool_calls"


class ErrorKind(enum.StrEnum):
    """Whose fault a failed request is: the server maps this to an HTTP status."""

    #: A resource refused it for good (`AdmitRuntimeError`): the request can never be served
    #: as asked, e.g. it needs more KV pages than the pool has. A client error (400).
    REJECTED = "rejected"
    #: The engine failed while running it. A server error (500).
    INTERNAL = "internal"


@dataclass(frozen=True)
class RequestError:
    """A typed failure: what kind, which resource refused (if one did), a user-facing message."""

    kind: ErrorKind
    message: str
    resource: str | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the `k` most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    #: 1 + how many tokens are more likely (vLLM's `rank`); set for prompt tokens only.
    rank: int | None = None


@dataclass(frozen=True)
class EngineEvent:
    """Something the scheduler did to one request: an admit refusal, an eviction, a reload...

    `name` is one of `admit_refused`, `evicted`, `offloaded`, `reloaded`, `recomputed`;
    `attributes` carry the reason type, failed resource, pages short and label where known.
    """

    name: str
    time: float
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """One request's progress since the previous step (deltas, not totals)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: FinishReason | None = None
    #: Set when `finish_reason is FinishReason.ERROR`.
    error: RequestError | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    #: Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    events: list[EngineEvent] = field(default_factory=list)
    #: With `SamplingParams.prompt_logprobs`: the prompt's tokens 1.. scored (the first token
    #: has no context), delivered once, with the output that follows the last prefill step.
    prompt_logprobs: list[TokenLogprob] | None = None
    #: Monotonic times: arrival, first scheduled, first token, finish (None until they happen).
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
