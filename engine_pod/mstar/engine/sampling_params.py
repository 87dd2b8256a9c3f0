"""Per-request sampling parameters, validated once at arrival so the engine never sees bad ones.

Also the one statement of the request limits the server publishes: the float parameters'
ranges (`FLOAT_BOUNDS`, which the OpenAPI document reads) and the context-length rule
(`context_overflow`, which both the engine and the server refuse with).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple


class InvalidParameter(ValueError):
    """A sampling parameter out of range; `param` names it for the OpenAI-style error body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Bound(NamedTuple):
    """A closed range ``[lo, hi]``, or ``(lo, hi]`` when ``lo_open``."""

    lo: float
    hi: float
    lo_open: bool = False

    def holds(self, value: float) -> bool:
        above = self.lo < value if self.lo_open else self.lo <= value
        return above and value <= self.hi

    def __str__(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"


#: Each float parameter's range, in the order `SamplingParams.validate` checks them.
FLOAT_BOUNDS: dict[str, Bound] = {
    "temperature": Bound(0.0, 2.0),
    "top_p": Bound(0.0, 1.0, lo_open=True),
    "min_p": Bound(0.0, 1.0),
    "repetition_penalty": Bound(0.0, 2.0, lo_open=True),
    "presence_penalty": Bound(-2.0, 2.0),
    "frequency_penalty": Bound(-2.0, 2.0),
}


#: `logit_bias` values are clamped to this range by OpenAI; here they are checked against it.
LOGIT_BIAS_BOUND = 100.0


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: any JSON object, or a JSON schema (as text).

    Plain data: the sampler compiles it (`resources.sampling.grammar.GrammarBackend`).
    """

    kind: Literal["json_object", "json_schema"]
    schema: str = ""
    #: Objects take no properties the schema does not name (OpenAI's `strict`); otherwise
    #: JSON-schema semantics (`additionalProperties` defaults to allowed).
    strict: bool = True
    #: Tool calls as the alternative (`tool_choice` auto with a `response_format`): the JSON
    #: schema of one call; the output is then either the content above or 1..`max_calls`
    #: ``<tool_call>`` blocks each holding one call.
    calls: str = ""
    max_calls: int = 1

    @classmethod
    def json_schema(cls, schema: dict[str, Any], strict: bool = True) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema), strict)


def context_overflow(
    prompt_len: int, max_tokens: int, max_model_len: int, prompt: str = "prompt"
) -> tuple[str, str] | None:
    """The parameter to blame and the message when a prompt of ``prompt_len`` tokens plus
    ``max_tokens`` new ones do not fit the context, else None (``prompt``: the prompt's name
    in the message, e.g. "messages"). The blamed parameter is "prompt" or "max_tokens"."""
    limit = f"This model's maximum context length is {max_model_len} tokens. However,"
    if prompt_len >= max_model_len:
        return "prompt", (
            f"{limit} your prompt has {prompt_len} tokens, leaving no room for a completion."
        )
    if prompt_len + max_tokens > max_model_len:
        return "max_tokens", (
            f"{limit} you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
            f"{prompt}, {max_tokens} in the completion). Please reduce the length of the "
            f"{prompt} or the completion."
        )
    return None


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
    #: Score the prompt: each prompt token's logprob and the k most likely at its position
    #: (vLLM's `prompt_logprobs`; OpenAI's `echo` with `logprobs`). None: not scored.
    prompt_logprobs: int | None = None
    #: EOS and `stop_token_ids` are not drawn before this many output tokens (a grammar, which
    #: decides itself where the output ends, is not overridden).
    min_tokens: int = 0
    #: token id -> added to its logit, before any filter (OpenAI's `logit_bias`).
    logit_bias: dict[int, float] = field(default_factory=dict)
    #: Constrains the output to a grammar (structured outputs, forced tool calls).
    grammar: GrammarSpec | None = None
    #: The LoRA adapter the request runs with (its `model` names it); None: the base model.
    lora_name: str | None = None

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
        for name, bound in FLOAT_BOUNDS.items():
            if not bound.holds(getattr(self, name)):
                raise InvalidParameter(name, f"{name} must be in {bound}")
        if self.top_k < -1:
            raise InvalidParameter("top_k", "top_k must be -1, 0 (disabled) or positive")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise InvalidParameter(
                "logprobs", f"logprobs must be between 0 and {self.MAX_LOGPROBS}"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS:
            raise InvalidParameter(
                "prompt_logprobs", f"prompt_logprobs must be between 0 and {self.MAX_LOGPROBS}"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParameter("stop_token_ids", "stop_token_ids must be non-negative")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidParameter("min_tokens", "min_tokens must be between 0 and max_tokens")
        for token, bias in self.logit_bias.items():
            if token < 0:
                raise InvalidParameter("logit_bias", f"logit_bias key {token} is not a token id")
            if not -LOGIT_BIAS_BOUND <= bias <= LOGIT_BIAS_BOUND:
                raise InvalidParameter(
                    "logit_bias", f"logit_bias values must be in [-100, 100], got {bias}"
                )
