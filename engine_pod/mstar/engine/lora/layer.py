"""`LoraLinear`: a LoRA wrapper around any linear method's runtime module, and `LoraRows`, the
step's rows -> adapter slots that every wrapper of a decoder reads.

The wrapper keeps, per output part of its projection (fused Q/K/V and gate/up have several),
every slot's A [S, R, in] and B^T [S, R, n] in the model's dtype; the pool writes a slot when it
loads an adapter. A step's forward adds each part's update for the rows whose request names an
adapter (`mstar.kernels.lora.lora_add_`); a step with no adapter rows runs the base alone.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar.engine.lora.cuda_graph_lora import GraphLoraRows, lora_add_masked
from mstar.engine.lora.resource import LoraPlan
from mstar.engine.model.linear import LinearMethod, LinearSpec
from mstar.kernels.lora import lora_add_, token_slots


@dataclass(frozen=True)
class LoraSegments:
    """Rows in runs of one slot: ``indptr`` [G+1] and ``slot`` [G] (host int64), and each
    row's slot on the device for the gathered path (None on the C++ path)."""

    indptr: torch.Tensor
    slot: torch.Tensor
    rows: torch.Tensor | None

    @staticmethod
    def of(lengths: Sequence[int], slots: Sequence[int], device: torch.device,
           gathered: bool) -> LoraSegments:  # fmt: skip
        merged_len: list[int] = []
        merged_slot: list[int] = []
        for n, s in zip(lengths, slots, strict=True):
            if merged_slot and merged_slot[-1] == s:
                merged_len[-1] += n
            else:
                merged_len.append(n)
                merged_slot.append(s)
        indptr = torch.zeros(len(merged_len) + 1, dtype=torch.long)
        torch.cumsum(torch.tensor(merged_len, dtype=torch.long), 0, out=indptr[1:])
        slot = torch.tensor(merged_slot, dtype=torch.long)
        return LoraSegments(indptr, slot, token_slots(indptr, slot, device) if gathered else None)


class LoraRows:
    """This step's row -> slot map for every `LoraLinear` of one decoder: all the step's
    tokens, and the sampled rows alone (the last layer runs o_proj and the MLP only for
    those: `Decoder.forward`'s pruning), told apart by row count."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        #: the C++ kernels (`cpu_kernels.load()`), or None: gathered torch matmuls
        self.kernels: Any | None = None
        #: every layer's slices as `cpu_kernels.decode_layers` adds them (a ``LoraDecode``;
        #: `LoraManager` builds it where the decoder has the packed fused decode), or None:
        #: a step with adapter rows goes layer by layer
        self.decode: Any | None = None
        self.full: LoraSegments | None = None
        self.kept: LoraSegments | None = None
        #: the graph decode's per-slot row buffers (`ModelRunner.setup_graphs`), or None
        self.graph: GraphLoraRows | None = None

    @property
    def active(self) -> bool:
        """Some row of this step uses an adapter."""
        return self.full is not None

    def begin(self, plan: LoraPlan | None, kept: Sequence[int]) -> None:
        """A step by its `LoraPlan` (None: no row names an adapter); ``kept``: the flat rows
        whose logits are computed."""
        self.full = self.kept = None
        if plan is None or all(s < 0 for s in plan.slots):
            return
        gathered = self.kernels is None or self.device.type != "cpu"
        self.full = LoraSegments.of(plan.lengths, plan.slots, self.device, gathered)
        ends = self.full.indptr[1:].tolist()
        seg = self.full.slot.tolist()
        kept_slots = [seg[bisect_right(ends, row)] for row in kept]
        self.kept = LoraSegments.of([1] * len(kept), kept_slots, self.device, gathered)

    @property
    def fused(self) -> bool:
        """This step may run `cpu_kernels.decode_layers` (no adapter rows, or the kernel adds
        them: `fused_step`); never inside a graph forward, which `LoraLinear` adds to."""
        if self.graph is not None and self.graph.current is not None:
            return False
        return self.full is None or self.decode is not None

    @contextmanager
    def fused_step(self) -> Iterator[None]:
        """Around one `decode_layers` call: it adds this step's adapter rows' updates after
        each projection (the same `lora_add_` calls, in the same order, as the layer path)."""
        if self.full is None or self.decode is None:
            yield
            return
        self.decode.begin(self.full.indptr, self.full.slot)
        try:
            yield
        finally:
            self.decode.end()

    def for_rows(self, n: int) -> LoraSegments | None:
        full = self.full
        if full is None:
            return None
        return full if int(full.indptr[-1]) == n else self.kept


class LoraSlice:
    """One output part of a projection: every slot's A, B^T, rank and scale."""

    def __init__(
        self, slots: int, rank: int, in_features: int, out_features: int, offset: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.offset = offset
        self.a = torch.zeros(slots, rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, rank, out_features, dtype=dtype, device=device)
        self.ranks = torch.zeros(slots, dtype=torch.long)
        # on the device: a captured graph reads them (`cuda_graph_lora`)
        self.scales = torch.zeros(slots, dtype=torch.float32, device=device)

    def write(
        self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None, scale: float
    ) -> None:
        """Put an adapter's (A [r, in], B [n, r]) in ``slot`` (None: it leaves this part alone)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if pair is None:
            self.ranks[slot] = 0
            self.scales[slot] = 0.0
            return
        a, b = pair
        r = a.shape[0]
        self.a[slot, :r].copy_(a)
        self.b[slot, :r].copy_(b.t())
        self.ranks[slot] = r
        self.scales[slot] = scale


class LoraLinear(nn.Module):
    """``base(x)`` plus each row's adapter update on every part of the projection."""

    def __init__(self, base: nn.Module, spec: LinearSpec, rows: LoraRows, slots: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        super().__init__()
        self.base = base
        self.spec = spec
        self.rows = rows
        parts = spec.parts or (spec.out_features,)
        offsets = [sum(parts[:i]) for i in range(len(parts))]
        self.slices = [
            LoraSlice(slots, max_rank, spec.in_features, n, off, dtype, device)
            for n, off in zip(parts, offsets, strict=True)
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base.forward(x)
        graph = self.rows.graph
        if graph is not None and graph.current is not None:  # a graph bucket's every row
            for s in self.slices:
                lora_add_masked(y, x, s.a, s.b, s.scales, graph.current, s.offset)
            return y
        seg = self.rows.for_rows(x.shape[0])
        if seg is None:
            return y
        for s in self.slices:
            lora_add_(y, x, s.a, s.b, s.ranks, s.scales, seg.indptr, seg.slot, s.offset,
                      kernels=self.rows.kernels, slots=seg.rows)  # fmt: skip
        return y


class LoraLinearMethod:
    """The linear seam's LoRA method: builds and loads through the ``inner`` method, and wraps
    the module that method finalised (which may already be finalised: `Linears.finalize` is
    run again with this method once the base model is loaded)."""

    def __init__(self, inner: LinearMethod, rows: LoraRows, slots: int, max_rank: int,
                 dtype: torch.dtype) -> None:  # fmt: skip
        self.inner = inner
        self.rows = rows
        self.slots = slots
        self.max_rank = max_rank
        self.dtype = dtype

    def create(self, spec: LinearSpec, dtype: torch.dtype, device: torch.device) -> nn.Module:
        return self.inner.create(spec, dtype, device)

    def load(self, module: nn.Module, kind: str, tensors: Sequence[torch.Tensor]) -> None:
        self.inner.load(module, kind, tensors)

    def finalize(self, spec: LinearSpec, module: nn.Module) -> nn.Module:
        base = self.inner.finalize(spec, module)
        if isinstance(base, LoraLinear) or spec.name == "lm_head":
            return base
        device = self.rows.device
        return LoraLinear(base, spec, self.rows, self.slots, self.max_rank, self.dtype, device)
