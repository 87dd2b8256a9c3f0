"""`ModelRunner`: turns an admitted step into tensors, runs the decoder and the sampler.

The scheduler decides *what* runs; the model runner only executes it: plan every resource
(KV page tables, attention plan, positions, sampling rows), gather the step's input tokens,
run the forward over the flat mixed prefill/decode batch, and sample the rows that end their
known tokens. It never commits: `Scheduler.update` does, so a failed step leaves every
resource exactly where admission left it (the scheduler aborts the step).

Two GPU features hang off it, both optional and both off the CPU default path:

- **CUDA graphs** (`setup_graphs`, machinery in `cuda_graphs`): a batched-decode step leased to
  a bucket replays that (bucket, slot)'s graph; every other step runs eager.
- **Pre-planning**: while step N's forward runs (asynchronously on CUDA), the resources that
  pre-plan stage step N+1's plan for the rows the scheduler predicts will run next
  (`next_decode_step`); the next real step promotes it when it matches, and the
  `StepRunner` clears every resource's stage when it does not.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mstar.engine.batch import (
    DECODE_WALK,
    ScheduledBatch,
    StepResult,
    eager_context,
    next_decode_step,
)
from mstar.engine.cuda_graphs import (
    NUM_SLOTS,
    CudaGraphRunner,
    SlotRotation,
    graphs_off_reason,
    pad_ids,
)
from mstar.engine.lora.cuda_graph_lora import GraphLoraRows
from mstar.engine.model.decoder import Decoder
from mstar.engine.outputs import ErrorKind, RequestError
from mstar.engine.overlap import InFlight, step_input_ids
from mstar.engine.resource_keys import ATTN, KV, LORA, ROPE, SAMPLER
from mstar.engine.resources.host_copy import to_device
from mstar.engine.resources.kv.plan import KVPlan, build_plan
from mstar.engine.resources.runner import StepRunner
from mstar.engine.resources.sampling import SamplerResource
from mstar.engine.resources.sampling.prompt_logprobs import score_prompt_rows
from mstar.engine.resources.step import (
    ResourceStep,
    SlotLease,
    StepContext,
)
from mstar.kernels import FlashInferPagedAttention

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        decoder: Decoder,
        runner: StepRunner,
        sampler: SamplerResource,
        device: torch.device,
        *,
        preplan: bool = False,
        overlap: bool = False,
    ) -> None:
        """``overlap``: the engine runs `OverlapLoop`: sampled tokens stay on the device."""
        self.decoder = decoder
        self.runner = runner
        self.sampler = sampler
        self.device = device
        self.preplan = preplan and bool(runner.preplan_order)
        self.rotation = SlotRotation(NUM_SLOTS)
        self.graphs: CudaGraphRunner | None = None
        self.preplans = 0
        #: called with (input ids, KV plan, logits rows) right before each eager forward: the
        #: tensor-parallel executor broadcasts the step to the other ranks there
        self.before_forward: Callable[[torch.Tensor, KVPlan, torch.Tensor], None] | None = None
        self.overlap = overlap

    # -- setup -----------------------------------------------------------------------------------
    def setup_graphs(
        self, sizes: Sequence[int], enforce_eager: bool, max_seq_len: int, *, capture: bool = True
    ) -> str | None:
        """Capture decode graphs when this device and backend allow; the reason when not.

        ``capture=False`` (tests) builds the same buckets, slots and padded static buffers but
        runs them eagerly instead of recording graphs.
        """
        attention = self.runner.resources[ATTN]
        backend = getattr(attention, "backend", None)
        if getattr(attention, "windows", ()) and self.device.type == "cuda" and not enforce_eager:
            # FlashInfer's graph decode wrapper is planned without a window.
            log.info("CUDA graphs off (sliding-window layers): every step runs eager")
            return "sliding-window layers"
        why = graphs_off_reason(
            enforce_eager=enforce_eager,
            sizes=sizes,
            cuda=self.device.type == "cuda",
            flashinfer=isinstance(backend, FlashInferPagedAttention),
            capture=capture,
        )
        if why is not None:
            log.info("CUDA graphs off (%s): every step runs eager", why)
            return why
        graphs = CudaGraphRunner(self.decoder, sizes, self.device, capture=capture)
        if self.decoder.lora_rows is not None:  # adapters replay inside the graphs too
            graphs.lora = GraphLoraRows(NUM_SLOTS, graphs.max_bs, self.device)
            self.decoder.lora_rows.graph = graphs.lora
        # Static buffers are ordinary tensors (made outside inference mode), so any later
        # in-place write to them is legal whatever mode it runs in.
        self.runner.build_cuda_graph_buffers(graphs.specs(), graphs.max_bs, max_seq_len)
        graphs.build_buffers()
        with torch.inference_mode():
            graphs.capture(self._plan_padding_step)
        self.graphs = graphs
        return None

    def _plan_padding_step(self, lease: SlotLease) -> tuple[torch.Tensor, Any]:
        """Plan positions and attention for a step whose every row is padding (capture)."""
        kv = self.runner.resources[KV]
        empty = build_plan((), {}, kv.page_size, self.device)  # type: ignore[attr-defined]
        ctx = StepContext([], DECODE_WALK, lease.slot, True, slot_lease=lease)
        ctx.plan_results[KV] = empty
        positions = self.runner.resources[ROPE].plan(ResourceStep(), ctx)
        attn = self.runner.resources[ATTN].plan(ResourceStep(), ctx)
        return positions, attn

    @property
    def leasing(self) -> bool:
        return self.graphs is not None or self.preplan

    def step_context(self, request_ids: list[str], batched_decode: bool) -> StepContext:
        """The context the scheduler declares a step with: a slot lease when graphs or
        pre-planning are on (the bucket only for a batched-decode step that fits one)."""
        if not self.leasing:
            return eager_context(request_ids, batched_decode)
        slot = self.rotation.peek()
        bucket = None
        if self.graphs is not None:
            bucket = self.graphs.bucket_for(len(request_ids), batched_decode)
        ctx = StepContext(request_ids, DECODE_WALK, slot, False, slot_lease=SlotLease(slot, bucket))
        if bucket is not None:
            ctx.set_padded_rids(pad_ids(slot, request_ids, bucket.bs))
        return ctx

    # -- per step --------------------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch, prev: InFlight | None = None) -> StepResult:
        """Run one admitted step; an exception becomes a typed internal error for its rows.

        ``prev``: the overlap loop's step in flight; its tokens feed this step's reserved slots
        from the device, and this step's tokens stay there too (`SampleOutput.deferred`).
        """
        try:
            return self._forward(batch, prev)
        except Exception:
            log.exception("step failed; its requests are failed")
            self.runner.clear_preplan()
            return StepResult(
                None, RequestError(ErrorKind.INTERNAL, "internal error while running the model")
            )

    def _forward(self, batch: ScheduledBatch, prev: InFlight | None) -> StepResult:
        plans = self.runner.plan(batch.step)
        lease = batch.step.ctx.slot_lease
        if lease is not None:
            self.rotation.take(lease.slot)
        with torch.inference_mode():
            input_ids = step_input_ids(batch, prev, self.device)
            if lease is not None and lease.bucket is not None and self.graphs is not None:
                logits = self.graphs.run(
                    lease, input_ids, plans[ROPE], plans[ATTN], plans.get(LORA)
                )
            else:
                # Row ends from the host (the plan's indptr is on the device: reading it syncs).
                ends = list(itertools.accumulate(r.num_tokens for r in batch.rows))
                rows = [ends[i] - 1 for i in batch.sample_rows]
                # Scored prompt positions get logits too, after the sampled rows.
                rows += [s.flat + j for s in batch.scored for j in range(len(s.targets))]
                index = to_device(rows, torch.long, self.device)
                if self.decoder.lora_rows is not None:
                    self.decoder.lora_rows.begin(plans.get(LORA), rows)
                if self.before_forward is not None:
                    self.before_forward(input_ids, plans[KV], index)
                logits = self.decoder(input_ids, plans[ROPE], plans[ATTN], index)
            # The forward is queued on the device: plan the next step meanwhile.
            self._preplan_next(batch)
            n = len(batch.sample_rows)
            scores = []
            if batch.scored:  # never a graph step (a batched decode scores nothing)
                groups = [s.targets for s in batch.scored]
                scores = score_prompt_rows(logits[n:], groups, [s.top for s in batch.scored])
                logits = logits[:n]
            sampled = self.sampler.sample(plans[SAMPLER], logits, self.overlap) if n else None
            return StepResult(sampled, prompt_scores=scores)

    def _preplan_next(self, batch: ScheduledBatch) -> None:
        if not self.preplan:
            return
        nxt = next_decode_step(batch)
        if nxt is None:
            return
        nxt.set_ctx(self.step_context([r.request.request_id for r in batch.rows], True))
        nxt.ctx.is_preplan = True
        if self.runner.pre_admit(nxt).ok:
            self.runner.pre_plan(nxt)
            self.preplans += 1
        else:
            self.runner.clear_preplan()
