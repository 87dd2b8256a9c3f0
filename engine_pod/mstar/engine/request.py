"""A request's engine-side state: its live token list, how much of it the KV cache holds, status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from mstar.engine.outputs import EngineEvent, FinishReason, RequestError, TokenLogprob
from mstar.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never run, or dropped for recomputation: needs (re)prefill
    RUNNING = "running"  # holds device KV and is scheduled every step
    OFFLOADED = "offloaded"  # its KV sits in host memory until reload
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    #: prompt + generated tokens; the KV resource keys prefix pages from this very list.
    token_ids: list[int] = field(default_factory=list)
    #: tokens whose K/V the cache holds (mirrors the KV stream's stored length).
    num_computed: int = 0
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    last_active_step: int = -1
    hold_until: float = 0.0
    #: per-resource overrides handed to `runner.ingest_request` (kept for recomputation).
    overrides: dict[str, Any] = field(default_factory=dict)
    pending_events: list[EngineEvent] = field(default_factory=list)
    pending_tokens: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    finish_reason: FinishReason | None = None
    error: RequestError | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def event(self, name: str, time: float, **attributes: Any) -> None:
        self.pending_events.append(EngineEvent(name, time, attributes))
