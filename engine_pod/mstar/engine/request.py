"""A request's engine-side state. One owner per fact:

- the token list is written only through `Request.append_token`; resources get a read-only
  `TokenView` of it (the KV cache keys prefix pages from it);
- `num_computed` is whatever the KV cache has committed: the scheduler copies it from the cache
  after each commit, prefix match and reset, and never computes it by hand;
- sampler state (output count, penalty counts) lives in the sampler resource.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from mstar.engine.outputs import (
    EngineEvent,
    FinishReason,
    RequestError,
    RequestOutput,
    TokenLogprob,
)
from mstar.engine.sampling_params import SamplingParams

#: The value a reserved token slot holds until its token is read from the device.
RESERVED_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never run, or dropped for recomputation: needs (re)prefill
    RUNNING = "running"  # holds device KV and is scheduled every step
    OFFLOADED = "offloaded"  # its KV sits in host memory (or is on its way there or back)
    FINISHED = "finished"


class TokenView(Sequence[int]):
    """Read-only live view of a request's tokens (prompt + generated), for resources."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: list[int]) -> None:
        self._tokens = tokens

    def __len__(self) -> int:
        return len(self._tokens)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._tokens[index]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    _tokens: list[int] = field(default_factory=list, repr=False)
    #: Tokens whose K/V the cache holds: a copy of the KV stream's committed length.
    num_computed: int = 0
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    last_active_step: int = -1
    #: Not scheduled (nor reloaded) before this time: an evicted victim's back-off.
    hold_until: float = 0.0
    #: Not chosen as a victim before this time: it was just admitted or reloaded.
    protected_until: float = 0.0
    num_evictions: int = 0
    #: Trailing token slots whose values are still on the device (the overlap loop's
    #: one-step lag): positions to compute, not outputs yet.
    num_reserved: int = 0
    #: The reserved token will end the request by length: it is not scheduled again.
    awaiting_final: bool = False
    #: per-resource overrides handed to `runner.ingest_request`.
    overrides: dict[str, Any] = field(default_factory=dict)
    pending_events: list[EngineEvent] = field(default_factory=list)
    pending_tokens: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    #: Scores of prompt tokens 1..len (`SamplingParams.prompt_logprobs`), in order: a prefill
    #: step scores the positions past the last one scored, so a recomputed prefill (after an
    #: eviction) scores nothing twice.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    _prompt_logprobs_sent: bool = False
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    finish_reason: FinishReason | None = None
    error: RequestError | None = None

    def __post_init__(self) -> None:
        self._tokens = list(self.prompt_token_ids)
        self.token_view = TokenView(self._tokens)

    @property
    def token_ids(self) -> Sequence[int]:
        return self.token_view

    def append_token(self, token: int, logprob: TokenLogprob | None) -> None:
        """The one writer of the token list: a sampled token, delivered with the next output.
        It fills the oldest reserved slot when there is one (`reserve_token`)."""
        if self.num_reserved:
            self._tokens[len(self._tokens) - self.num_reserved] = token
            self.num_reserved -= 1
        else:
            self._tokens.append(token)
        self.pending_tokens.append(token)
        if logprob is not None:
            self.pending_logprobs.append(logprob)

    def reserve_token(self) -> None:
        """A slot for a token sampled on the device but not read yet; the next step computes
        it from the device tensor, `append_token` fills it one step later."""
        self._tokens.append(RESERVED_TOKEN)
        self.num_reserved += 1

    def drop_reserved(self) -> None:
        """Forget unread tokens of a request that ended: they are never outputs."""
        if self.num_reserved:
            del self._tokens[len(self._tokens) - self.num_reserved :]
            self.num_reserved = 0

    def tokens_to_compute(self, num_tokens: int) -> list[int]:
        """The next `num_tokens` tokens the cache does not hold yet."""
        start = self.num_computed
        return self._tokens[start : start + num_tokens]

    @property
    def scores_prompt(self) -> bool:
        """Prompt tokens are still to be scored (their positions must run, not be matched)."""
        wanted = self.params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    def score_span(self, num_tokens: int) -> tuple[int, int]:
        """Positions ``[first, end)`` of the next ``num_tokens`` computed whose logits score a
        prompt token (position p scores token p + 1); empty when none do."""
        if not self.scores_prompt:
            return 0, 0
        first = max(self.num_computed, len(self.prompt_logprobs))
        end = min(self.num_computed + num_tokens, len(self.prompt_token_ids) - 1)
        return first, max(first, end)

    def num_scored(self, num_tokens: int) -> int:
        """How many prompt positions the next ``num_tokens`` computed would score."""
        first, end = self.score_span(num_tokens)
        return end - first

    def _take_prompt_logprobs(self) -> list[TokenLogprob] | None:
        if self.params.prompt_logprobs is None or self._prompt_logprobs_sent:
            return None
        if self.scores_prompt and not self.finished:
            return None
        self._prompt_logprobs_sent = True
        return self.prompt_logprobs

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Outputs delivered or due with the next output (reserved slots are not yet)."""
        return len(self._tokens) - self.num_reserved - len(self.prompt_token_ids)

    @property
    def num_uncomputed(self) -> int:
        if self.awaiting_final and self.num_reserved:
            return 0  # its last token, in flight, ends it
        return len(self._tokens) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def event(self, name: str, time: float, **attributes: Any) -> None:
        self.pending_events.append(EngineEvent(name, time, attributes))

    def take_output(self) -> RequestOutput:
        """The request's progress since its previous output (deltas, then cleared)."""
        out = RequestOutput(
            request_id=self.request_id,
            new_token_ids=self.pending_tokens,
            new_logprobs=self.pending_logprobs if self.params.logprobs is not None else None,
            finished=self.finished,
            finish_reason=self.finish_reason,
            error=self.error,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=self.num_cached_tokens,
            events=self.pending_events,
            prompt_logprobs=self._take_prompt_logprobs(),
            arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            finished_time=self.finished_time,
        )
        self.pending_tokens, self.pending_logprobs, self.pending_events = [], [], []
        return out
