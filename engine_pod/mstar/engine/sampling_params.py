"""Per-request sampling parameters, validated once at arrival so the engine never sees bad ones."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidParameter(ValueError):
    """A sampling parameter out of range; `param` names it for the OpenAI-style error body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """What a request asks of the sampler. Greedy when `temperature == 0`.

    `top_k <= 0` and `top_p == 1` and `min_p == 0` disable those filters; penalties of
    1.0 (repetition) and 0.0 (presence, frequency) are the identity. `logprobs=None` returns
    none; `logprobs=k` returns the chosen token's log-probability and the k most likely.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise InvalidParameter("max_tokens", "max_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidParameter("temperature", "temperature must be in [0, 2]")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameter("top_p", "top_p must be in (0, 1]")
        if self.top_k < -1:
            raise InvalidParameter("top_k", "top_k must be -1, 0 (disabled) or positive")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameter("min_p", "min_p must be in [0, 1]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidParameter("repetition_penalty", "repetition_penalty must be in (0, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidParameter("presence_penalty", "presence_penalty must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidParameter("frequency_penalty", "frequency_penalty must be in [-2, 2]")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise InvalidParameter(
                "logprobs", f"logprobs must be between 0 and {self.MAX_LOGPROBS}"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParameter("stop_token_ids", "stop_token_ids must be non-negative")
