"""The step types the scheduler and the model runner share, and how a step is declared.

Plain data flows one way: the scheduler builds a `ScheduledBatch`, the model runner executes it
and hands back a `StepResult`. Both import this module and neither imports the other.
`declare_step` is context-free: the scheduler attaches the context it was built with (the model
runner's, which leases a CUDA-graph slot), and the model runner attaches its own to the step it
pre-plans (`next_decode_step`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from mstar.engine.outputs import RequestError, TokenLogprob
from mstar.engine.request import Request
from mstar.engine.resource_keys import ATTN, KV, LORA, ROPE, SAMPLER
from mstar.engine.resources.kv import MAIN_LABEL
from mstar.engine.resources.sampling import SampleOutput
from mstar.engine.resources.step import ResourceStep, Segment, StepContext, SubmoduleStep

#: Graph walk of the decoder's forward (the only walk this engine runs or captures).
DECODE_WALK = "llm"

__all__ = [
    "DECODE_WALK",
    "ScheduledBatch",
    "ScheduledRow",
    "ScoredRows",
    "StepResult",
    "cap_scored",
    "declare_step",
    "eager_context",
    "is_batched_decode",
    "next_decode_step",
    "prompt_scores",
]


class ScheduledRow(NamedTuple):
    request: Request
    num_tokens: int


class ScoredRows(NamedTuple):
    """Prompt tokens one row scores this step: the logits of the step's flat token ``flat``
    onwards score ``targets`` (the prompt tokens that follow), with the ``top`` most likely."""

    row: int
    flat: int
    targets: list[int]
    top: int


@dataclass
class ScheduledBatch:
    """An admitted step: its rows, the declared step, the rows that sample a token and the
    prompt tokens it scores (`prompt_scores`)."""

    rows: list[ScheduledRow]
    step: SubmoduleStep
    sample_rows: list[int]
    scored: list[ScoredRows] = field(default_factory=list)


@dataclass
class StepResult:
    """What the model runner hands back: the sampled tokens and the prompt scores (one list
    per `ScheduledBatch.scored` entry), or the error that stopped it."""

    sampled: SampleOutput | None
    error: RequestError | None = None
    prompt_scores: list[list[TokenLogprob]] = field(default_factory=list)


def cap_scored(req: Request, n: int, room: int) -> tuple[int, int]:
    """``n`` tokens of ``req`` cut so the row scores at most ``room`` prompt positions; the
    chunk and the room left after it."""
    first, end = req.score_span(n)
    if end - first > room:
        n, end = first - req.num_computed + room, first + room
    return n, room - (end - first)


def prompt_scores(rows: list[ScheduledRow]) -> list[ScoredRows]:
    """The prompt tokens each row scores this step (`Request.score_span`), before it runs."""
    scored: list[ScoredRows] = []
    flat = 0
    for i, r in enumerate(rows):
        req = r.request
        first, end = req.score_span(r.num_tokens)
        if end > first:
            targets = req.prompt_token_ids[first + 1 : end + 1]
            top = req.params.prompt_logprobs or 0
            scored.append(ScoredRows(i, flat + first - req.num_computed, targets, top))
        flat += r.num_tokens
    return scored


def declare_step(rows: list[ScheduledRow]) -> tuple[SubmoduleStep, list[int]]:
    """The step over `rows` (one main-label Segment per request), without a context, and the
    rows that sample this step (those that reach the end of their known tokens)."""
    segments = [Segment(r.request.request_id, MAIN_LABEL, r.num_tokens) for r in rows]
    steps: dict[str, ResourceStep] = {KV: ResourceStep(), ATTN: ResourceStep()}
    steps[ROPE] = ResourceStep()
    if any(LORA in r.request.overrides for r in rows):
        steps[LORA] = ResourceStep()  # some row names an adapter
    sample_rows = [i for i, r in enumerate(rows) if r.num_tokens == r.request.num_uncomputed]
    if sample_rows:
        steps[SAMPLER] = ResourceStep(tuple(segments[i] for i in sample_rows))
    return SubmoduleStep(steps, segments), sample_rows


def is_batched_decode(rows: list[ScheduledRow], sample_rows: list[int]) -> bool:
    """Every row one token and every row sampling: the only step a CUDA graph replays."""
    return len(sample_rows) == len(rows) and all(r.num_tokens == 1 for r in rows)


def next_decode_step(batch: ScheduledBatch) -> SubmoduleStep | None:
    """The step after `batch` if nothing changes: its rows decoding one more token each.

    Only a batched decode is predicted (a prefill's next chunk depends on the budget). It is a
    guess to pre-plan against; a real step that differs clears the stage.
    """
    if not is_batched_decode(batch.rows, batch.sample_rows):
        return None
    return declare_step([ScheduledRow(r.request, 1) for r in batch.rows])[0]


def eager_context(request_ids: list[str], batched_decode: bool) -> StepContext:
    """The context of a step that leases no CUDA-graph slot (no graphs, no pre-planning)."""
    return StepContext(request_ids, DECODE_WALK, 0, False)
