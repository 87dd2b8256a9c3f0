"""`CopyWorker`: the one thread that runs host<->device page copies off the scheduler's thread.

Jobs run one at a time in submission order (an offload queued before a reload of the same
request lands first). The thread lives only while there is work: it starts on the first
submit and exits once the queue is empty, so an idle cache holds no thread.

Tests hold copies in flight deterministically: `pause()` keeps queued jobs from starting,
`step(n)` lets the next ``n`` run and waits for them, `resume()` lets everything run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["CopyWorker"]

log = logging.getLogger(__name__)


class CopyWorker:
    """A FIFO of copy jobs drained by a single worker thread."""

    def __init__(self, name: str = "mstar-kv-copy") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[Callable[[], None]] = deque()
        self._thread: threading.Thread | None = None
        self._running = 0  # jobs taken off the queue and not finished yet
        self._done = 0  # jobs finished, ever (what `step` waits on)
        self._paused = False
        self._credits = 0  # jobs allowed to start while paused

    @property
    def num_pending(self) -> int:
        """Jobs queued or running."""
        with self._cond:
            return len(self._queue) + self._running

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; it must not raise (what it raises is logged and dropped)."""
        with self._cond:
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _runnable(self) -> bool:
        return bool(self._queue) and (not self._paused or self._credits > 0)

    def _loop(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self._runnable():
                    if not self._queue:
                        self._thread = None  # idle: the next submit starts a new thread
                        return
                    cond.wait()
                job = self._queue.popleft()
                if self._paused:
                    self._credits -= 1
                self._running += 1
            try:
                job()
            except Exception:
                log.exception("KV copy job failed")
            finally:
                with cond:
                    self._running -= 1
                    self._done += 1
                    cond.notify_all()

    # -- test and shutdown hooks ---------------------------------------------------------------
    def pause(self) -> None:
        """Queued jobs stay queued (one already running finishes) until `step` or `resume`."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._credits = 0
            self._cond.notify_all()

    def step(self, n: int = 1, timeout: float | None = None) -> int:
        """While paused, run the next ``n`` queued jobs and wait for them; returns how many."""
        with self._cond:
            if not self._paused:
                raise RuntimeError("CopyWorker.step is for a paused worker; call pause() first")
            k = min(n, len(self._queue) - self._credits)
            if k <= 0:
                return 0
            target = self._done + self._running + self._credits + k
            self._credits += k
            self._cond.notify_all()
            self._wait(lambda: self._done >= target, timeout)
            return k

    def wait_progress(self, timeout: float) -> bool:
        """Block until a queued or running job finishes, or ``timeout`` passes; at once when
        nothing is queued. For a caller that can do nothing until a copy lands: spinning instead
        would keep taking the lock the landing needs (and the GIL), and starve this thread.
        False when there was nothing to wait for."""
        with self._cond:
            if not self._queue and not self._running:
                return False
            done = self._done
            self._cond.wait_for(lambda: self._done != done, timeout)
            return True

    def wait_idle(self, timeout: float | None = None) -> None:
        """Block until nothing is queued or running. Never call it holding the KV lock."""
        with self._cond:

            def idle() -> bool:
                if self._paused and self._queue and not self._running and not self._credits:
                    raise RuntimeError(
                        f"the KV copy worker is paused with {len(self._queue)} copies queued"
                    )
                return not self._queue and not self._running

            self._wait(idle, timeout)

    def _wait(self, done: Callable[[], bool], timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("KV copies still in flight after the timeout")
            self._cond.wait(left)
