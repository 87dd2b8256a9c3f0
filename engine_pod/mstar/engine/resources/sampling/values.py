"""The sampler's values: what a request brings, one step's gathered plan, a step's draw."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.engine.outputs import TokenLogprob
from mstar.engine.sampling_params import SamplingParams

__all__ = ["RequestState", "SampleOutput", "SamplerPlan", "SamplerRequestConfig"]


@dataclass
class SamplerRequestConfig:
    """What the sampler is told at arrival: the parameters and the prompt (repetition penalty)."""

    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestState:
    """The sampler's per-request record: its parameter-table slot, penalty row, features."""

    params: SamplingParams
    slot: int
    pen_row: int
    features: int
    top_k: int
    logprobs: int | None
    seed_base: int | None
    num_output: int = 0
    #: The grammar's matcher (xgrammar), advanced at commit; None without a grammar.
    matcher: Any = None
    #: The matcher refused a committed token (cannot happen with its mask applied): ends it.
    grammar_broken: bool = False
    #: `logit_bias` as (token ids, values) tensors; None without one.
    bias: tuple[torch.Tensor, torch.Tensor] | None = None
    #: Token ids held back until `params.min_tokens` outputs (EOS and stop ids); None: none.
    min_suppress: torch.Tensor | None = None


@dataclass(slots=True)
class SamplerPlan:
    """One step's gathered parameters. Tensors are None when no row of the batch needs them."""

    request_ids: tuple[str, ...]
    #: Batch rows whose token commit records (real, known requests; padding rows are left out).
    commit_rows: tuple[int, ...]
    all_greedy: bool
    #: `[rows]` bool: rows to answer by argmax. None when no row is greedy or all are.
    greedy: torch.Tensor | None
    temperature: torch.Tensor | None
    top_k: torch.Tensor | None
    top_k_max: int
    top_p_cut: torch.Tensor | None
    #: Every row with top-p on also has top-k on (top-p then needs only the top `top_k_max`).
    top_p_in_top_k: bool
    log_min_p: torch.Tensor | None
    #: Penalty inputs: table rows of each batch row (0 = the all-zero row) and parameters.
    pen_rows: torch.Tensor | None
    repetition: torch.Tensor | None
    presence: torch.Tensor | None
    frequency: torch.Tensor | None
    #: Batch rows that use seeded noise, with each row's key for this output index.
    seeded_rows: torch.Tensor | None
    seeded_keys: torch.Tensor | None
    #: Rows that want generator noise (sampled and unseeded).
    any_random: bool
    #: (batch row, k) for rows asking for logprobs.
    logprob_rows: tuple[tuple[int, int], ...]
    #: `seeded_rows` on the host: `plan` derives `seeded_keys` from them at every step.
    seeded_index: tuple[int, ...] = ()
    #: Rows with a grammar, rows with a logit bias, rows with `min_tokens` (static).
    grammar_rows: tuple[int, ...] = ()
    bias_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    min_token_rows: tuple[int, ...] = ()
    #: Per step: the grammar masks being filled, the (row, token) pairs held back.
    masks: Future[Any] | None = None
    suppress: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    @property
    def use_penalties(self) -> bool:
        return self.pen_rows is not None


@dataclass
class SampleOutput:
    """One token per row; `logprobs[i]` is None for a row that did not ask for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None
    #: The same tokens on the device, for feeding the next step without a host round trip.
    token_tensor: torch.Tensor
    #: Row -> finish reason for rows whose grammar ended ("stop") or has no token left
    #: ("grammar_dead_end"): their token is not an output, the request ends.
    ended: dict[int, str] = field(default_factory=dict)
    #: The tokens were left on the device (`token_ids` is empty): the overlap loop reads
    #: them one step later.
    deferred: bool = False
