"""`ModelRunner`: turns an admitted step into tensors, runs the decoder and the sampler.

The scheduler decides *what* runs; the model runner only executes it: plan every resource
(KV page tables, attention plan, positions, sampling rows), gather the step's input tokens,
run the forward over the flat mixed prefill/decode batch, and sample the rows that end their
known tokens. It never commits: `Scheduler.update` does, so a failed step leaves every
resource exactly where admission left it (the scheduler aborts the step).
"""

from __future__ import annotations

import logging

import torch

from mstar.engine.model.decoder import Decoder
from mstar.engine.outputs import ErrorKind, RequestError
from mstar.engine.resource_keys import ATTN, KV, ROPE, SAMPLER
from mstar.engine.resources.runner import StepRunner
from mstar.engine.resources.sampling import SampleOutput, SamplerResource
from mstar.engine.scheduler import ScheduledBatch, StepResult

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        decoder: Decoder,
        runner: StepRunner,
        sampler: SamplerResource,
        device: torch.device,
    ) -> None:
        self.decoder = decoder
        self.runner = runner
        self.sampler = sampler
        self.device = device

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run one admitted step; an exception becomes a typed internal error for its rows."""
        try:
            return StepResult(self._forward(batch))
        except Exception:
            log.exception("step failed; its requests are failed")
            return StepResult(
                None, RequestError(ErrorKind.INTERNAL, "internal error while running the model")
            )

    def _forward(self, batch: ScheduledBatch) -> SampleOutput | None:
        plans = self.runner.plan(batch.step)
        tokens: list[int] = []
        for r in batch.rows:
            tokens.extend(r.request.tokens_to_compute(r.num_tokens))
        input_ids = torch.tensor(tokens, dtype=torch.long).to(self.device, non_blocking=True)
        ends = plans[KV].qo_indptr[1:].tolist()
        logits_indices = torch.tensor([ends[i] - 1 for i in batch.sample_rows], dtype=torch.long)
        with torch.inference_mode():
            logits = self.decoder(
                input_ids, plans[ROPE], plans[ATTN], logits_indices.to(self.device)
            )
            if not batch.sample_rows:
                return None
            return self.sampler.sample(plans[SAMPLER], logits)
