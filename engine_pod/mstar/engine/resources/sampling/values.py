"""The sampler's values: what a request brings, one step's gathered plan, a step's draw."""

from __future__ import annotations

from dataclasses import dataclass, field

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
