"""The scheduler's update half: commit an executed step, deliver its tokens, apply stops.

Split in two so the overlap loop (`engine.overlap`) can commit a step's lengths before its
tokens are read (the next step is scheduled meanwhile) and deliver them one step later; the
synchronous `update` does both at once. A request that ended in between (a stop found in the
previous step's token, an abort) gets nothing from a step still in flight for it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from mstar.engine.batch import ScheduledBatch, StepResult
from mstar.engine.outputs import FinishReason, RequestError, RequestOutput, TokenLogprob
from mstar.engine.request import Request

if TYPE_CHECKING:
    from mstar.engine.resources.kv.capacity import KVCapacity
    from mstar.engine.resources.runner import StepRunner
    from mstar.engine.scheduler import SchedulerConfig

__all__ = ["StepUpdate"]


class StepUpdate:
    """Mixed into `Scheduler`, which owns these queues and the `_finish` bookkeeping."""

    runner: StepRunner
    kv: KVCapacity
    step_index: int
    requests: dict[str, Request]
    _touched: dict[str, Request]
    _finished: list[Request]
    config: SchedulerConfig

    def _finish(
        self, req: Request, reason: FinishReason, error: RequestError | None = None
    ) -> None:
        raise NotImplementedError  # Scheduler's

    def update(
        self, batch: ScheduledBatch | None, result: StepResult | None
    ) -> list[RequestOutput]:
        """Commit the executed step, record sampled tokens, end what stopped; the outputs."""
        if batch is not None and result is not None:
            self.settle(batch, result)
        return self.collect_outputs()

    def settle(self, batch: ScheduledBatch, result: StepResult) -> None:
        """Commit and deliver a step at once (its tokens read now if still on the device),
        or fail its requests when it failed."""
        if result.error is not None:
            self.runner.abort_step(batch.step)
            for r in batch.rows:
                if not r.request.finished:
                    self._finish(r.request, FinishReason.ERROR, result.error)
            return
        self.commit(batch, result)
        if (s := result.sampled) is not None:
            ids = s.token_tensor.tolist() if s.deferred else s.token_ids
            self.apply_sampled(batch, ids, s.logprobs, s.ended)

    def commit(self, batch: ScheduledBatch, result: StepResult) -> None:
        """Advance every resource past the executed step (lengths; no token value needed)."""
        self.runner.commit(batch.step)
        kv, step_index = self.kv, self.step_index
        for scored, scores in zip(batch.scored, result.prompt_scores, strict=True):
            batch.rows[scored.row].request.prompt_logprobs.extend(scores)
        for r in batch.rows:
            req = r.request
            if req.finished:  # ended while its step ran (the overlap loop's lag, an abort)
                continue
            req.num_computed = kv.stored_len(req.request_id)
            req.last_active_step = step_index
            self._touched[req.request_id] = req

    def apply_sampled(
        self,
        batch: ScheduledBatch,
        token_ids: list[int],
        logprobs: list[TokenLogprob | None] | None,
        ended: dict[int, str],
    ) -> None:
        """Deliver the step's sampled tokens and end what stopped. A request that ended
        before they were read (one step late) gets none: its extra token is discarded."""
        done = time.monotonic()
        for j, i in enumerate(batch.sample_rows):
            req = batch.rows[i].request
            if req.finished:
                continue
            if j in ended:  # its grammar ended: the drawn token is not an output
                self._finish(req, FinishReason(ended[j]))
                continue
            token = token_ids[j]
            req.append_token(token, None if logprobs is None else logprobs[j])
            if req.first_token_time is None:
                req.first_token_time = done
            reason = self._stop_reason(req, token)
            if reason is not None:
                self._finish(req, reason)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        if (
            not params.ignore_eos and token in self.config.eos_token_ids
        ) or token in params.stop_token_ids:
            return FinishReason.STOP
        # Delivered tokens only: a reserved slot after this one is not an output yet.
        outputs = req.num_output_tokens
        if (
            outputs >= params.max_tokens
            or req.num_prompt_tokens + outputs >= self.config.max_model_len
        ):
            return FinishReason.LENGTH
        return None

    def collect_outputs(self) -> list[RequestOutput]:
        outputs = [
            req.take_output()
            for req in self._touched.values()
            if req.pending_tokens or req.pending_events
        ]
        self._touched.clear()
        for req in self._finished:
            outputs.append(req.take_output())
            del self.requests[req.request_id]
        self._finished.clear()
        return outputs
