"""What the engine hands back each step: per-request token deltas, lifecycle times and events.

The server turns these into HTTP responses, metrics and span events; the engine never calls
telemetry itself, so observation cannot steer it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the `k` most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    #: "stop" (EOS or a stop token), "length", "abort" or "error".
    finish_reason: str | None = None
    #: User-facing message when `finish_reason == "error"`.
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    #: Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    events: list[EngineEvent] = field(default_factory=list)
    #: Monotonic times: arrival, first scheduled, first token, finish (None until they happen).
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
