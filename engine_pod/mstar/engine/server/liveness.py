"""`Liveness`: does the engine loop still make progress? What `/health` and `/ready` report.

A live thread is no proof: a step that never returns (a kernel that spins, a copy that never
lands, a device that stops answering) keeps the thread alive while every request on it hangs
(SGLang #4191 is this bug in a peer). So the engine thread stamps the time of its last step that
moved something, and the loop side asks whether work has been pending for longer than a bound
without such a step. An idle engine is never stalled.

The bound is the larger of the configured floor (`--stall-timeout-seconds`) and
`STALL_MULTIPLE` times the slowest step seen, so a deployment whose steps are legitimately long
(a big model, a long prompt chunk) is not declared hung by its own slowness.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: A step slower than 1/STALL_MULTIPLE of the bound is normal for this deployment; the bound
#: grows with it.
STALL_MULTIPLE = 4.0


class Liveness:
    """Progress stamps written by the engine thread, read by the event loop (floats: no lock)."""

    def __init__(self, floor_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        """``floor_seconds``: the shortest stall that counts; 0 disables the check."""
        self.floor = floor_seconds
        self._clock = clock
        self.slowest_step = 0.0
        #: When the engine last moved something, or last took up work after an idle spell.
        self.progress_at = clock()
        #: The engine thread has work (requests or commands) it has not finished.
        self.busy = False

    # -- engine thread ---------------------------------------------------------------------------
    def woke(self) -> None:
        """The thread took up work; a stall is counted from now if it was idle."""
        if not self.busy:
            self.busy = True
            self.progress_at = self._clock()

    def stepped(self, seconds: float, progressed: bool) -> None:
        """A step returned after ``seconds``; ``progressed``: it ran a batch or ended a request."""
        self.slowest_step = max(self.slowest_step, seconds)
        if progressed:
            self.progress_at = self._clock()

    def idle(self) -> None:
        """Nothing left to do: the thread waits for commands."""
        self.busy = False

    # -- any thread ------------------------------------------------------------------------------
    def bound(self) -> float:
        return max(self.floor, STALL_MULTIPLE * self.slowest_step)

    def stall(self) -> str | None:
        """Why the engine counts as hung, or None while it makes progress (or is idle)."""
        if self.floor <= 0 or not self.busy:
            return None
        quiet = self._clock() - self.progress_at
        bound = self.bound()
        if quiet <= bound:
            return None
        return (
            f"engine stalled: work pending and no step completed for {quiet:.1f}s (bound "
            f"{bound:.1f}s: the larger of --stall-timeout-seconds {self.floor:g} and "
            f"{STALL_MULTIPLE:g} x the slowest step, {self.slowest_step:.2f}s)"
        )
