"""The overlap loop: step N+1 is scheduled and launched before step N's tokens are read.

vLLM calls it async scheduling, SGLang the overlap scheduler. The synchronous loop waits for
the device at every step (the sampler's `.tolist()`), then schedules and plans the next step
while the device idles. Here one `OverlapLoop.step`:

1. commits the step in flight (lengths, sampler counters and penalty counts: no token value
   is needed on the host for that);
2. schedules the next step; a request whose last token is still on the device holds a
   *reserved* slot (`Request.reserve_token`) and decodes it: its input id is gathered from the
   previous step's token tensor on the device (`step_input_ids`);
3. launches it (queued on CUDA; on CPU it runs here);
4. reads the previous step's tokens (a copy started when they were drawn) and delivers them:
   stops, max tokens and EOS apply exactly as in the synchronous loop.

A request that ends at 4 (a stop, an abort before it) may already be in the launched step: its
extra token is discarded at delivery, never streamed, and its pages went back when it ended
(the KV cache and sampler skip a removed request's commit). A request whose reserved token
ends it by length (`max_tokens`, the context) is not scheduled again, so it costs nothing.
Steps whose tokens the host needs at once (logprobs, grammars, prompt scores) deliver at launch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mstar.engine.batch import ScheduledBatch, StepResult
from mstar.engine.outputs import RequestOutput
from mstar.engine.request import RESERVED_TOKEN, Request
from mstar.engine.resources.host_copy import to_device

if TYPE_CHECKING:
    from mstar.engine.engine import LLMEngine

__all__ = ["InFlight", "OverlapLoop", "TokenReadback", "step_input_ids"]


class TokenReadback:
    """A step's sampled tokens on their way to the host, the copy queued as they are drawn
    (pinned memory and an event on CUDA: waiting for it never waits for a later step)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens
        self._event: torch.cuda.Event | None = None
        self._host = tokens
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        out: list[int] = self._host.tolist()
        return out


@dataclass
class InFlight:
    """A launched step whose tokens the host has not read: its batch, result and readback."""

    batch: ScheduledBatch
    result: StepResult
    readback: TokenReadback
    started: float

    def token_rows(self) -> dict[str, int]:
        """Request id -> row of the step's token tensor."""
        rows = self.batch.rows
        return {rows[i].request.request_id: j for j, i in enumerate(self.batch.sample_rows)}


def step_input_ids(
    batch: ScheduledBatch, prev: InFlight | None, device: torch.device
) -> torch.Tensor:
    """The step's flat input ids: host tokens, and for a reserved slot (always a request's last
    token, drawn by `prev`) the token gathered from `prev`'s tensor on the device."""
    tokens: list[int] = []
    at: list[int] = []
    src: list[int] = []
    rows = prev.token_rows() if prev is not None else {}
    for r in batch.rows:
        chunk = r.request.tokens_to_compute(r.num_tokens)
        if chunk and chunk[-1] == RESERVED_TOKEN:
            row = rows.get(r.request.request_id)
            if row is None:
                raise RuntimeError(f"request {r.request.request_id!r}: token not in flight")
            at.append(len(tokens) + len(chunk) - 1)
            src.append(row)
            chunk[-1] = 0
        tokens.extend(chunk)
    ids = to_device(tokens, torch.long, device)
    if at:
        assert prev is not None
        picked = prev.readback.tokens.index_select(0, to_device(src, torch.long, device))
        ids.index_copy_(0, to_device(at, torch.long, device), picked)
    return ids


def ends_by_length(req: Request, max_model_len: int) -> bool:
    """Counting its reserved slots, the request has all its tokens: it ends by length."""
    return (
        req.num_tokens - req.num_prompt_tokens >= req.params.max_tokens
        or req.num_tokens >= max_model_len
    )


class OverlapLoop:
    """Drives the engine's schedule -> execute -> update with tokens read one step late."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.inflight: InFlight | None = None

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        scheduler = eng.scheduler
        prev, self.inflight = self.inflight, None
        if prev is not None:
            scheduler.commit(prev.batch, prev.result)
        batch = scheduler.schedule()
        launched: InFlight | None = None
        if batch is not None:
            eng.executed_steps += 1
            started = time.perf_counter()
            result = eng.model_runner.execute(batch, prev)
            if result.error is None and result.sampled is not None and result.sampled.deferred:
                launched = InFlight(
                    batch, result, TokenReadback(result.sampled.token_tensor), started
                )
                self._reserve(batch, eng.max_model_len)
            else:  # failed, or its tokens are on the host already: settle in step order
                if prev is not None:
                    self._deliver(prev)
                    prev = None
                scheduler.observe_cost(batch, time.perf_counter() - started)
                scheduler.settle(batch, result)
        if prev is not None:
            self._deliver(prev)
        self.inflight = launched
        return scheduler.collect_outputs()

    @staticmethod
    def _reserve(batch: ScheduledBatch, max_model_len: int) -> None:
        for i in batch.sample_rows:
            req = batch.rows[i].request
            req.reserve_token()
            req.awaiting_final = ends_by_length(req, max_model_len)

    def _deliver(self, step: InFlight) -> None:
        scheduler = self.engine.scheduler
        tokens = step.readback.result()
        scheduler.observe_cost(step.batch, time.perf_counter() - step.started)
        scheduler.apply_sampled(step.batch, tokens, None, {})  # deferred: no grammar ended
