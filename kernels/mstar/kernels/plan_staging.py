"""Page-locked host arrays for one FlashInfer wrapper's plan, and the event that frees them.

A FlashInfer ``plan`` writes its schedule into the wrapper's page-locked host buffer and queues
an asynchronous copy to the device without waiting for it; the step's page-table arrays, staged
here in page-locked memory too, are copied the same way. Re-planning the same wrapper rewrites
those host bytes, so it must not start before the device has read the last plan's copies: two
prefill-only steps in a row (a long prompt chunked over several steps) sample nothing and so
never synchronise otherwise, and the second plan could overwrite the first one's schedule before
its copy ran (wrong attention, or an illegal address). mini-sglang fixed the same race the
same way.

`PlanStaging.stage` therefore waits on the event `PlanStaging.queued` recorded right after the
previous plan queued its copies: it blocks only until those copies (and the work queued before
them) are done, never on the step that follows them. On the CPU (tests) the arrays are ordinary
memory and the event is whatever the caller passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch


class Event(Protocol):
    """The part of `torch.cuda.Event` used here."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class HostPlan(NamedTuple):
    """A step's CSR arrays as views of the staging buffer (int32, host)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor


class PlanStaging:
    """One wrapper's page-locked plan arrays, rewritten only after the device read them."""

    def __init__(
        self,
        device: torch.device | str,
        new_event: Callable[[], Event] | None = None,
        capacity: int = 1024,
    ) -> None:
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._event: Event = (new_event or torch.cuda.Event)()
        self._pending = False
        self._host = self._alloc(capacity)
        #: re-plans that waited on the previous plan's event first (instant once it has passed)
        self.waits = 0

    def _alloc(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int32, pin_memory=self._pin)

    def wait(self) -> None:
        """Block until the copies the last plan queued have run (no-op when none is pending)."""
        if self._pending:
            self._event.synchronize()
            self._pending = False
            self.waits += 1

    def stage(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        last_page_len: torch.Tensor,
    ) -> HostPlan:
        """Copy the step's arrays into the page-locked buffer, once the device has read the
        previous plan's (FlashInfer's own host buffer is free again at the same point)."""
        self.wait()
        parts = (qo_indptr, kv_indptr, kv_indices, last_page_len)
        sizes = [p.numel() for p in parts]
        total = sum(sizes)
        if total > self._host.numel():
            self._host = self._alloc(2 * total)
        views = torch.split(self._host[:total], sizes)
        for view, part in zip(views, parts, strict=True):
            view.copy_(part)
        return HostPlan(*views)

    def queued(self) -> None:
        """The wrapper's plan has queued every copy out of page-locked memory: mark it."""
        self._event.record()
        self._pending = True
