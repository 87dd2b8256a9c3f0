"""How many prompt tokens the next serving step carries, from the measured cost of steps.

A step's time is close to linear in its work (weights streamed once, then per-row compute):

    seconds ~ base + per_decode * decode_rows + per_prompt * prompt_tokens
              + per_scored * scored_rows

(a scored row is a prompt position whose logits are computed to score the next prompt token,
`SamplingParams.prompt_logprobs`: one more LM-head row and its log-softmax.)
`StepCostModel` fits those four numbers online from the steps the engine runs (exponentially
weighted least squares, pulled toward the previous estimate so a run of same-shaped steps cannot
make it singular). `StepBudget` turns the fit into the next step's token budget:

- **Stall bound** (running streams keep their pace): while requests decode, a step that carries
  prompt chunks takes at most ``stall_factor * sqrt(max(1, waiting / decoding))`` times the
  decode-only step of the same streams, and never needs to be shorter than
  ``min_step_seconds``. This is the latency-bounded chunk of Sarathi-Serve's stall-free
  batching; a fixed token count cannot be that bound, because a decode row's cost and a prompt
  token's cost change with the machine, the dtype and the batch. The decoding streams pay the
  stall and the waiting requests gain from it, so the stall each stream accepts grows with how
  many wait per stream (its square root: measured on the serving benchmark at concurrency 32,
  an all-or-nothing switch between the two regimes gave 1.6x the median time to first token
  and 1.4x the p99 inter-token gap).
- **A wave** (prompts arriving at an idle engine together, as a client's batch or a restarted
  load balancer sends them, and those that keep arriving until its last prompt is prefilled):
  the step takes the pending prompts whole, up to the cap. Every stream is stalled by the
  wave's later steps anyway, so starting some a step sooner buys their first token little and
  costs the wave's last one (the p99 time to first token) every extra step's fixed cost.
  Measured on the serving benchmark's closed loop (SmolLM2, 2-core Xeon with AMX, a replay of
  the engine's steps) with a first version that told a wave by its streams (none past its first
  token): concurrency 8, TTFT p50 / p99 40-52 / 263-268 ms -> 170 / 178-186, ITL p99 47-52 ->
  21-22; concurrency 32, 284-465 / 1044-1374 -> 460-477 / 840-858, output tok/s 780-792 ->
  863-897 (the waves stay together, so later steps decode without prompt chunks). That version
  missed a batch landing over more than two steps (forced AVX2, concurrency 8: ITL p99 193 ms),
  so the wave is now the scheduler's flag; with it, forced AVX2 at 8 served ITL p99 32-35 ms
  (README, Performance).
- **Burst absorption** (few steps for a queue of prompts beside decoding streams): under the
  stall bound, the chunk that minimises the queue's mean time to first token. With ``P``
  prompt tokens queued, every step paying ``overhead`` (base plus the decode rows) and ``c``
  prompt tokens per step, the mean wait is about ``(overhead + c * per_prompt) * (P / c + 1) /
  2``, least at ``c = sqrt(P * overhead / per_prompt)``: larger steps pay the overhead less
  often, smaller ones let the queue's head start sooner. The oldest prompt goes whole when the
  bound lets it, and in a burst (as many requests waiting as decoding) even when it does not:
  one request's first token a step sooner beats every waiting prompt advancing a little.
- A prompt that is scored costs ``per_prompt + per_scored`` a token: the budget gives the
  pending prompts' share of scored tokens that price, so a scored chunk is shorter.
- Never fewer than ``min_tokens`` prompt tokens (prompts always progress), never above the cap
  (``--max-num-batched-tokens``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

#: Starting guess (seconds): refined after the first few steps; only its order of magnitude
#: matters (SmolLM2 bf16 on 2 Zen 5 cores: ~8 ms base, ~1.2 ms a decode row, ~0.85 ms a prompt
#: token; a scored row: LM head and log-softmax, ~a fifth of a token's FLOPs).
PRIOR = (0.010, 0.0005, 0.0005, 0.0001)


@dataclass
class StepCostModel:
    """Online fit of ``seconds ~ base + per_decode * decode_rows + per_prompt * prompt_tokens
    + per_scored * scored_rows``."""

    #: Weight kept by past steps at each new one (an effective memory of ~1/(1-decay) steps).
    decay: float = 0.97
    #: Pull toward the previous estimate, in steps' worth of weight (keeps the solve regular).
    anchor: float = 0.5
    coef: tuple[float, float, float, float] = PRIOR
    steps: int = 0
    _xx: np.ndarray = field(default_factory=lambda: np.zeros((4, 4)))
    _xy: np.ndarray = field(default_factory=lambda: np.zeros(4))
    _weight: float = 0.0

    def predict(self, decode_rows: int, prompt_tokens: int, scored_rows: int = 0) -> float:
        base, per_decode, per_prompt, per_scored = self.coef
        prompt = per_prompt * prompt_tokens + per_scored * scored_rows
        return base + per_decode * decode_rows + prompt

    def observe(
        self, decode_rows: int, prompt_tokens: int, seconds: float, scored_rows: int = 0
    ) -> None:
        """Add one executed step. A step several times slower than predicted (a first call of a
        new GEMM shape, the host busy elsewhere) is clipped so one outlier cannot swing the fit."""
        if self.steps >= 8:
            seconds = min(seconds, 2.0 * self.predict(decode_rows, prompt_tokens, scored_rows))
        x = np.array([1.0, decode_rows, prompt_tokens, scored_rows])
        self._xx = self.decay * self._xx + np.outer(x, x)
        self._xy = self.decay * self._xy + x * seconds
        self.steps += 1
        self._weight = self.decay * self._weight + 1.0
        # Solved in columns scaled to unit weight (rows count tens, tokens hundreds), with a ridge
        # toward the previous coefficients worth `anchor` steps of the decayed total.
        scale = np.sqrt(np.maximum(np.diag(self._xx), 1e-12))
        ridge = self.anchor / self._weight
        a = self._xx / np.outer(scale, scale) + ridge * np.eye(4)
        b = self._xy / scale + ridge * np.asarray(self.coef) * scale
        solved = np.maximum(np.linalg.solve(a, b) / scale, 0.0)
        self.coef = (
            float(solved[0]),
            float(solved[1]),
            max(float(solved[2]), 1e-7),
            float(solved[3]),
        )


@dataclass
class StepBudget:
    """The next serving step's token budget (decode rows plus prompt tokens)."""

    cap: int
    stall_factor: float = 3.0
    min_step_seconds: float = 0.050
    min_tokens: int = 32
    model: StepCostModel = field(default_factory=StepCostModel)

    def tokens(
        self,
        decode_rows: int,
        prompts: int,
        pending_prompt: int,
        head_prompt: int,
        wave: bool = False,
        scored_share: float = 0.0,
    ) -> int:
        """Budget for a step with ``decode_rows`` streams decoding and ``prompts`` requests still
        to prefill ``pending_prompt`` tokens (running chunks and waiting prompts), ``head_prompt``
        of them the oldest's. ``wave``: prompts have been pending since nobody decoded (the
        scheduler's flag), so every decoding stream is the wave's own. ``scored_share``: the
        fraction of the pending prompt tokens that are scored (`prompt_logprobs`)."""
        if pending_prompt <= 0:
            return self.cap
        if decode_rows == 0 or wave:
            return max(1, min(decode_rows + pending_prompt, self.cap))
        base, _, per_token, per_scored = self.model.coef
        per_prompt = per_token + scored_share * per_scored
        overhead = self.model.predict(decode_rows, 0)
        # Streams stall while a step carries prompts: bound by how many wait per stream.
        factor = self.stall_factor * math.sqrt(max(1.0, prompts / decode_rows))
        allowed = max(factor * overhead, self.min_step_seconds) - overhead
        bound = int(allowed / per_prompt)
        absorb = int(math.sqrt(pending_prompt * max(overhead, base) / per_prompt))
        if head_prompt <= bound or prompts >= decode_rows:  # the oldest prompt goes whole
            chunk = max(absorb, head_prompt)
            bound = max(bound, head_prompt)
        else:
            chunk = absorb
        chunk = max(min(chunk, bound), self.min_tokens)
        return max(1, min(decode_rows + chunk, self.cap))

    def observe(
        self, decode_rows: int, prompt_tokens: int, seconds: float, scored_rows: int = 0
    ) -> None:
        self.model.observe(decode_rows, prompt_tokens, seconds, scored_rows)
