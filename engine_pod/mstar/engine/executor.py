"""The executor: what the engine hands each admitted step to, between the scheduler and the
model runner.

The scheduler's plain data (the `ScheduledBatch`: token ids by request, the KV plan's page
tables and slots, the sampling rows) goes to `execute`, which returns the `StepResult` the
scheduler commits. Admission, planning, sampling and commit stay on rank 0 either way:

- `LocalExecutor`: the model runner on this process's device (one rank; today's path, one
  call, nothing added);
- `TensorParallelExecutor`: rank 0 of a tensor-parallel replica. Right before its own forward
  the model runner broadcasts the step (`parallel.channel.StepChannel`) and every rank runs its
  shard; the all-reduces and the logits gather inside the forward join them. A failed step, or
  a worker rank gone, takes the replica down: `execute` raises `RankFailure`, which ends the
  engine loop (the server then fails every request and exits non-zero), and `failure` tells the
  server's watchdog between steps.
"""

from __future__ import annotations

import logging
from typing import Protocol

from mstar.engine.batch import ScheduledBatch, StepResult
from mstar.engine.model_runner import ModelRunner
from mstar.engine.parallel.channel import StepChannel
from mstar.engine.parallel.group import LeaderRanks

log = logging.getLogger(__name__)

#: how long a failed step waits to see which worker exited (for the error message)
EXIT_GRACE_SECONDS = 2.0


class RankFailure(RuntimeError):
    """A rank of this replica died or a collective failed: the replica cannot step again."""


class Executor(Protocol):
    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run one admitted step on every rank; rank 0's sampled tokens come back."""
        ...

    def failure(self) -> str | None:
        """Why this executor can run no more steps (None: it can)."""
        ...

    def close(self) -> None:
        """Release the ranks (no-op on one)."""
        ...


class LocalExecutor:
    """One rank: the model runner itself."""

    def __init__(self, model_runner: ModelRunner) -> None:
        self.model_runner = model_runner

    def execute(self, batch: ScheduledBatch) -> StepResult:
        return self.model_runner.execute(batch)

    def failure(self) -> str | None:
        return None

    def close(self) -> None:
        pass


class TensorParallelExecutor:
    """Rank 0 of a tensor-parallel replica (see the module doc)."""

    def __init__(self, model_runner: ModelRunner, ranks: LeaderRanks) -> None:
        self.model_runner = model_runner
        self.ranks = ranks
        self.channel = StepChannel(ranks.group, model_runner.device)
        model_runner.before_forward = self.channel.send
        self._failed: str | None = None
        self._closed = False

    def failure(self) -> str | None:
        return self._failed or self.ranks.failure()

    def execute(self, batch: ScheduledBatch) -> StepResult:
        why = self.failure()
        if why is not None:
            raise RankFailure(why)
        result = self.model_runner.execute(batch)
        if result.error is not None:
            # The ranks may have parted mid-forward: no later step can be trusted.
            workers = self.ranks.workers
            exited = workers.wait_failure(EXIT_GRACE_SECONDS) if workers is not None else None
            self._failed = exited or (
                "a tensor-parallel step failed (a rank died or a collective failed; see the log)"
            )
            raise RankFailure(self._failed)
        return result

    def close(self) -> None:
        """Stop the worker ranks' loops and leave the groups (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.failure() is None:
            try:
                self.channel.stop()
            except RuntimeError:
                log.exception("could not tell the worker ranks to stop")
        if self.ranks.workers is not None:
            self.ranks.workers.close()
        self.ranks.group.leave()
