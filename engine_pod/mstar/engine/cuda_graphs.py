"""CUDA-graph decode: buckets, slot leases, padding rows, static buffers, capture and replay.

An all-decode step of ``n`` rows (one token each, every row sampling) replays the graph of the
smallest captured batch size ``bs >= n``; anything else (prefill, mixed steps, ``n`` above the
largest bucket, ``--enforce-eager``, no FlashInfer) runs eager. Each bucket is captured twice,
once per slot: slots rotate globally, step after step, so the next step's plan writes the other
slot's buffers while this step's graph reads its own (the slot-keyed buffers are shared across
buckets, which is why a per-bucket counter would let consecutive steps collide).

Padding: the ``bs - n`` extra rows get ids ``__pad<slot>.<i>`` and a one-token layout over the
KV sink page (page 0, which the KV cache never hands to a request): they read and write only
that page, so a padded replay cannot touch a real request's cache. The resources pad their own
plans (`attention.pad_decode_layout`, `positions.pad_positions`) into static buffers
(`resources.static_buffers`); this module only names the rows and records the forward.

Everything here but `CudaGraphRunner.capture` is plain tensor bookkeeping and runs on CPU: the
runner in ``capture=False`` mode executes exactly the padded static-buffer forward a graph
records, eagerly, which is how CPU tests check padding and sink writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from mstar.engine.batch import DECODE_WALK
from mstar.engine.resources.static_buffers import GrowOnlyBuffers
from mstar.engine.resources.step import BucketKey, SlotLease

if TYPE_CHECKING:
    from mstar.engine.lora.cuda_graph_lora import GraphLoraRows
    from mstar.engine.lora.resource import LoraPlan

log = logging.getLogger(__name__)

NUM_SLOTS = 2
PAD_PREFIX = "__pad"


# ---------------------------------------------------------------------------------------------
# Pure decisions
# ---------------------------------------------------------------------------------------------


def choose_bucket(sizes: Sequence[int], num_rows: int) -> int | None:
    """The smallest captured batch size that holds ``num_rows``; None means eager."""
    fitting = [bs for bs in sizes if bs >= num_rows]
    return min(fitting) if fitting and num_rows > 0 else None


def decode_bucket(sizes: Sequence[int], num_rows: int, batched_decode: bool) -> BucketKey | None:
    """The bucket a step replays, or None for the eager fallback (prefill, mixed, too big)."""
    if not batched_decode:
        return None
    bs = choose_bucket(sizes, num_rows)
    return None if bs is None else BucketKey(DECODE_WALK, bs, bs)


def pad_ids(slot: int, request_ids: Sequence[str], bs: int) -> list[str]:
    """The step's rows under a lease: the real ids, then the slot's dummy ids up to ``bs``."""
    return [*request_ids, *(f"{PAD_PREFIX}{slot}.{i}" for i in range(len(request_ids), bs))]


def graphs_off_reason(
    *, enforce_eager: bool, sizes: Sequence[int], cuda: bool, flashinfer: bool, capture: bool
) -> str | None:
    """Why the engine captures no graphs (every step eager), or None when it captures."""
    if enforce_eager:
        return "--enforce-eager"
    if not sizes:
        return "no --cuda-graph-batch-sizes"
    if capture and not cuda:
        return "not a CUDA device"
    if capture and not flashinfer:
        return "the torch attention backend is not graph-capturable"
    return None


class GraphCaptureError(RuntimeError):
    """A decode bucket's CUDA graph could not be captured: the engine does not start."""


def capture_failure(bs: int, exc: BaseException) -> GraphCaptureError | None:
    """None when a bucket's failed capture may fall back to eager (out of device memory, which
    a smaller bucket set or more memory fixes), else the error that stops the engine: a capture
    that fails otherwise (a kernel off the capturing stream, a plan that does not fit its
    workspace) would fail the same way for every bucket, and an engine that then served every
    decode step eager, or failed them, would only hide it."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return None
    return GraphCaptureError(
        f"CUDA graph capture failed for decode batch size {bs}: {type(exc).__name__}: {exc}. "
        "Fix the cause, or start with --enforce-eager to serve without CUDA graphs."
    )


class SlotRotation:
    """Global slot counter: consecutive executed steps never share a slot."""

    def __init__(self, num_slots: int = NUM_SLOTS) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots = num_slots
        self._next = 0

    def peek(self) -> int:
        """The slot the next step will use (a pre-plan stages into it)."""
        return self._next

    def take(self, slot: int) -> None:
        """Step on ``slot`` is executing: the following step gets the next one."""
        self._next = (slot + 1) % self.num_slots


def slot_specs(sizes: Iterable[int], num_slots: int) -> list[SlotLease]:
    """Every (bucket, slot) to capture, largest bucket first (later ones slice its buffers)."""
    return [
        SlotLease(slot, BucketKey(DECODE_WALK, bs, bs))
        for bs in sorted(set(sizes), reverse=True)
        for slot in range(num_slots)
    ]


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------

#: plans one (bucket, slot) over an all-padding step: returns (positions, attention context)
PlanSlot = Callable[[SlotLease], tuple[torch.Tensor, Any]]


class CudaGraphRunner:
    """Picks buckets, and captures/replays the decoder's decode forward per (bucket, slot).

    ``capture=False`` runs the same padded static-buffer forward eagerly (CPU tests, and the
    per-bucket "graph replay equals eager" check on a GPU compares the two modes).
    """

    def __init__(
        self,
        decoder: Callable[..., torch.Tensor],
        sizes: Sequence[int],
        device: torch.device | str,
        *,
        capture: bool,
        num_slots: int = NUM_SLOTS,
    ) -> None:
        self.decoder = decoder
        self.sizes = tuple(sorted(set(sizes)))
        self.device = torch.device(device)
        self.capture_enabled = capture
        self.num_slots = num_slots
        self.buffers = [GrowOnlyBuffers(device) for _ in range(num_slots)]
        self._graphs: dict[SlotLease, tuple[Any, torch.Tensor]] = {}
        self._pool: Any = None
        self.replays = 0
        self.eager_runs = 0
        #: LoRA adapters served: the rows' adapter slots each (bucket, slot) reads
        #: (`ModelRunner.setup_graphs` sets it before capture), or None
        self.lora: GraphLoraRows | None = None

    @property
    def max_bs(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def specs(self) -> list[SlotLease]:
        return slot_specs(self.sizes, self.num_slots)

    def bucket_for(self, num_rows: int, batched_decode: bool) -> BucketKey | None:
        """The captured bucket this step replays; None runs it eager."""
        return decode_bucket(self.sizes, num_rows, batched_decode)

    # -- buffers ---------------------------------------------------------------------------------
    def build_buffers(self) -> None:
        for bufs in self.buffers:
            bufs.ensure("input_ids", self.max_bs, torch.int64)
            bufs.ensure("logits_indices", self.max_bs, torch.int64)
            bufs.get("logits_indices", self.max_bs).copy_(
                torch.arange(self.max_bs, dtype=torch.int64)
            )

    def static_forward(self, lease: SlotLease, positions: torch.Tensor, attn: Any) -> torch.Tensor:
        """The bucket's forward over the slot's static buffers: what a graph records."""
        assert lease.bucket is not None
        bs = lease.bucket.bs
        bufs = self.buffers[lease.slot]
        with nullcontext() if self.lora is None else self.lora.bound(lease.slot, bs):
            return self.decoder(
                bufs.get("input_ids", bs), positions, attn, bufs.get("logits_indices", bs)
            )

    # -- capture ---------------------------------------------------------------------------------
    def capture(self, plan_slot: PlanSlot) -> None:
        """Capture every (bucket, slot), largest first, into one memory pool.

        ``plan_slot`` plans the resources for an all-padding step on that slot (every row on the
        sink page). A bucket whose capture runs out of memory is dropped and its steps run eager;
        any other failure stops the engine (`capture_failure`).
        """
        self.build_buffers()
        if not self.capture_enabled:
            return
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        failed: set[int] = set()
        for spec in self.specs():
            assert spec.bucket is not None
            if spec.bucket.bs in failed:
                continue
            try:
                positions, attn = plan_slot(spec)
                self.buffers[spec.slot].get("input_ids", spec.bucket.bs).zero_()
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up: lazy inits and autotuning happen outside
                        self.static_forward(spec, positions, attn)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    out = self.static_forward(spec, positions, attn)
                self._graphs[spec] = (graph, out)
            except Exception as exc:
                fatal = capture_failure(spec.bucket.bs, exc)
                if fatal is not None:
                    raise fatal from exc
                log.warning(
                    "CUDA graph capture for %s ran out of memory; it runs eager", spec.bucket
                )
                failed.add(spec.bucket.bs)
        if failed:
            self._graphs = {s: g for s, g in self._graphs.items() if s.bucket.bs not in failed}  # type: ignore[union-attr]
            self.sizes = tuple(bs for bs in self.sizes if bs not in failed)
        torch.cuda.synchronize(self.device)
        log.info("captured %d CUDA graphs for decode batch sizes %s", len(self._graphs), self.sizes)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    # -- replay ----------------------------------------------------------------------------------
    def run(
        self,
        lease: SlotLease,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: Any,
        lora: LoraPlan | None = None,
    ) -> torch.Tensor:
        """Logits [n, vocab] of the step's real rows, from the slot's graph (or its eager twin).

        The resources already planned into the slot's static buffers (positions, write slots,
        the wrapper's indices); this stages the input ids, pad rows reading token 0, and with
        adapters served the rows' adapter slots from the step's ``lora`` plan.
        """
        assert lease.bucket is not None
        bs = lease.bucket.bs
        n = input_ids.shape[0]
        ids = self.buffers[lease.slot].get("input_ids", bs)
        ids[n:].zero_()
        ids[:n].copy_(input_ids, non_blocking=True)
        if self.lora is not None:
            self.lora.stage(lease.slot, bs, lora)
        captured = self._graphs.get(lease)
        if captured is None:
            self.eager_runs += 1
            logits = self.static_forward(lease, positions, attn)
        else:
            graph, logits = captured
            graph.replay()
            self.replays += 1
        return logits[:n]
