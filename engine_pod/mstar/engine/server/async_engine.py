"""`AsyncEngine`: the one thread that drives the (not thread-safe) engine for the asyncio server.

Handlers never touch the engine. They post add/abort commands to a locked inbox; the engine
thread drains it between steps, runs `step()`, and hands each step's outputs back to the event
loop in one `call_soon_threadsafe` batch, where each request's sink (an asyncio queue's
`put_nowait`) receives them. The thread sleeps on a condition variable when there is no work,
so an idle server costs no CPU, and the event loop never blocks on a forward pass.

The thread stamps its progress in a `Liveness`; the server's watchdog declares a stalled engine
dead (`fail`), as the thread does itself when a step raises. Death is final and loud: every live
request ends with an error, later adds are refused, and `dead` is set for the server to exit.

That thread is an `EngineThread`, and the server builds the engine on it too: torch's CPU kernels
run on an OpenMP team owned by the calling thread, so loading on one thread and stepping on
another leaves two teams fighting for the same cores (SmolLM2 batch-1 decode on 2 cores: 21.6
tok/s split across threads against 33.4 on one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from mstar.engine.outputs import ErrorKind, FinishReason, RequestError, RequestOutput
from mstar.engine.sampling_params import InvalidParameter, SamplingParams
from mstar.engine.server.liveness import Liveness

log = logging.getLogger(__name__)
T = TypeVar("T")

Sink = Callable[[RequestOutput], None]
#: When the engine has requests but ran nothing (all held, e.g. after an eviction's back-off),
#: wait this long (or until a command arrives) instead of spinning a core.
IDLE_POLL_SECONDS = 0.002


class EngineLike(Protocol):
    """What the server needs of `mstar.engine.engine.LLMEngine`."""

    model_name: str
    max_model_len: int
    tokenizer: Any
    kv: Any  # the KV cache resource: its page size and counts are exported once, at start
    #: `GrammarBackend`: the server compiles requests' grammars with it (a 400 when bad).
    grammar: Any
    #: Steps that ran a batch, ever (a step that only held its requests moved nothing).
    executed_steps: int

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> Any: ...


class StepObserver(Protocol):
    """Called on the engine thread after every step (metrics)."""

    def on_step(self, outputs: list[RequestOutput], stats: Any, now: float) -> None: ...


@dataclass
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: Sink
    arrival_time: float


@dataclass
class _Add:
    requests: list[NewRequest]
    done: asyncio.Future[None]


@dataclass
class _Abort:
    request_id: str


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (a step raised or hung); nothing more can be served."""


class EngineThread:
    """One daemon thread that runs, in order, whatever touches the model: load, then steps."""

    def __init__(self, name: str = "mstar-engine-loop") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue ``fn`` to run on this thread; its result (or exception) lands in the future."""
        future: Future[T] = Future()

        def job() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, not lost with the thread
                future.set_exception(exc)

        self._jobs.put(job)
        return future

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on this thread and wait for it (e.g. ``LLMEngine.from_config``)."""
        return self.submit(fn).result()

    def close(self) -> None:
        """Let the thread exit once the jobs already queued have run."""
        self._jobs.put(None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()


class AsyncEngine:
    def __init__(
        self,
        engine: EngineLike,
        observer: StepObserver | None = None,
        thread: EngineThread | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        """``thread``: the `EngineThread` the engine was built on (a new one if None);
        ``liveness``: where the step loop stamps its progress (no stall check if None)."""
        self.engine = engine
        self._observer = observer
        self._home = thread
        self.liveness = liveness if liveness is not None else Liveness(0.0)
        self._cond = threading.Condition()
        self._inbox: list[_Add | _Abort] = []
        self._queued_adds = 0
        #: Adds the engine thread took from the inbox and has not answered yet.
        self._unacked: list[asyncio.Future[None]] = []
        self._sinks: dict[str, Sink] = {}
        self._stopping = False
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        #: Set (on the event loop) once the engine is dead: the server exits on it.
        self.dead = asyncio.Event()
        self.stats: Any = engine.stats()
        self.steps = 0

    # -- lifecycle (event loop side) ---------------------------------------------------------------

    def start(self) -> None:
        """Start the step loop on the engine thread; call from the loop that consumes outputs."""
        self._loop = asyncio.get_running_loop()
        if self._home is None:
            self._home = EngineThread()
        self._home.submit(self._run)
        self._home.close()  # the thread ends when the step loop does
        self._started = True

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the step loop and wait for it; a dead engine's thread may hang, so not for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._started and self._home is not None and self.error is None:
            self._home.join(timeout)

    def fail(self, error: BaseException) -> None:
        """Declare the engine dead: every live request ends with ``error``'s message, every add
        from now on is refused, and `dead` is set. Idempotent; callable from any thread."""
        with self._cond:
            if self.error is not None:
                return
            self.error = error
            self._cond.notify()
        self._fail_all(str(error))
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closing meanwhile: nobody to tell
                loop.call_soon_threadsafe(self.dead.set)

    @property
    def alive(self) -> bool:
        home = self._home
        return self._started and home is not None and home.is_alive() and self.error is None

    def num_waiting(self) -> int:
        """Requests not yet running: the engine's waiting queue plus adds not yet handed over."""
        with self._cond:
            queued = self._queued_adds
        return int(getattr(self.stats, "num_waiting", 0)) + queued

    async def add_requests(self, requests: list[NewRequest]) -> None:
        """Hand requests to the engine; returns once it accepted all of them.

        All or nothing: if the engine refuses one (`InvalidParameter`), those already added are
        aborted and the error is raised here. If the caller is cancelled meanwhile (the client
        went away), every one of them is aborted.
        """
        if not self.alive:
            raise EngineDeadError(f"the engine is not running: {self.error}")
        assert self._loop is not None
        done: asyncio.Future[None] = self._loop.create_future()
        with self._cond:
            if self.error is not None:  # died since the check: `_fail_all` took the inbox
                raise EngineDeadError(f"the engine is not running: {self.error}")
            self._inbox.append(_Add(requests, done))
            self._queued_adds += len(requests)
            self._cond.notify()
        try:
            await done
        except asyncio.CancelledError:
            for r in requests:
                self.abort_request(r.request_id)
            raise

    def abort_request(self, request_id: str) -> None:
        """Ask the engine to stop a request and free its pages (no-op once it finished)."""
        with self._cond:
            self._inbox.append(_Abort(request_id))
            self._cond.notify()

    # -- engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as exc:  # the thread must report, not vanish
            log.exception("engine loop died")
            self.fail(EngineDeadError(f"engine failure: {exc}"))

    def _loop_forever(self) -> None:
        engine = self.engine
        live = self.liveness
        idle_wait: float | None = None
        while True:
            with self._cond:
                while (
                    not self._inbox
                    and not self._stopping
                    and self.error is None
                    and not engine.has_unfinished_requests()
                ):
                    live.idle()
                    self._cond.wait()
                live.woke()
                if idle_wait is not None and not self._inbox and not self._stopping:
                    self._cond.wait(idle_wait)
                if self.error is not None:  # declared dead (hung) while this thread was away
                    return
                if self._stopping:
                    commands, self._inbox = self._inbox, []
                    self._shutdown(commands)
                    return
                commands, self._inbox = self._inbox, []
                self._unacked = [c.done for c in commands if isinstance(c, _Add)]
            acks = self._apply(commands)
            started = time.monotonic()
            executed = engine.executed_steps
            outputs = engine.step() if engine.has_unfinished_requests() else []
            self.steps += 1
            now = time.monotonic()
            live.stepped(now - started, bool(outputs) or engine.executed_steps != executed)
            stats = engine.stats()
            self.stats = stats
            with self._cond:
                self._queued_adds -= sum(len(c.requests) for c in commands if isinstance(c, _Add))
            if self._observer is not None:
                try:
                    self._observer.on_step(outputs, stats, now)
                except Exception:
                    log.exception("step observer failed")
            deliveries: list[tuple[Sink, RequestOutput]] = []
            with self._cond:  # `fail` may take the sinks from the event loop
                dead = self.error is not None
                if not dead:
                    for out in outputs:
                        sink = self._sinks.pop(out.request_id, None) if out.finished else None
                        sink = sink or self._sinks.get(out.request_id)
                        if sink is not None:
                            deliveries.append((sink, out))
            if dead:  # declared hung mid-step: fail what this step took on, then stop
                self._fail_all(str(self.error))
                return
            if acks or deliveries:
                self._post(acks, deliveries)
            self._unacked = []
            busy = bool(outputs) or int(getattr(stats, "num_running", 0)) > 0
            idle_wait = None if busy else IDLE_POLL_SECONDS

    def _shutdown(self, commands: list[_Add | _Abort]) -> None:
        """Leave the engine empty: refuse pending adds, abort every live request."""
        acks: list[tuple[asyncio.Future[None], BaseException | None]] = [
            (c.done, EngineDeadError("the server is shutting down"))
            for c in commands
            if isinstance(c, _Add)
        ]
        for request_id in list(self._sinks):
            self.engine.abort_request(request_id)
        if self.engine.has_unfinished_requests():
            self.engine.step()  # collects the aborted requests (their pages are already free)
        self.stats = self.engine.stats()
        if acks:
            self._post(acks, [])

    def _apply(
        self, commands: list[_Add | _Abort]
    ) -> list[tuple[asyncio.Future[None], BaseException | None]]:
        acks: list[tuple[asyncio.Future[None], BaseException | None]] = []
        for cmd in commands:
            if isinstance(cmd, _Abort):
                if cmd.request_id in self._sinks:
                    self.engine.abort_request(cmd.request_id)
                continue
            added: list[str] = []
            error: BaseException | None = None
            for r in cmd.requests:
                try:
                    self.engine.add_request(
                        r.request_id, r.prompt_token_ids, r.params, arrival_time=r.arrival_time
                    )
                except Exception as exc:  # a refused request must not take the loop down
                    if not isinstance(exc, InvalidParameter | ValueError):
                        log.exception("engine refused request %s", r.request_id)
                    error = exc
                    break
                self._sinks[r.request_id] = r.sink
                added.append(r.request_id)
            if error is not None:
                for rid in added:
                    self.engine.abort_request(rid)
            acks.append((cmd.done, error))
        return acks

    def _post(
        self,
        acks: list[tuple[asyncio.Future[None], BaseException | None]],
        deliveries: list[tuple[Sink, RequestOutput]],
    ) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # The loop may close between the check and the call (shutdown).
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_deliver, acks, deliveries)

    def _fail_all(self, message: str) -> None:
        """After a fatal error, end every live request with an error and refuse every add not
        yet answered (queued, or taken by a step that never returned), so no handler hangs."""
        with self._cond:
            commands, self._inbox = self._inbox, []
            sinks, self._sinks = self._sinks, {}
            futures = [*self._unacked, *(c.done for c in commands if isinstance(c, _Add))]
        acks: list[tuple[asyncio.Future[None], BaseException | None]] = [
            (fut, EngineDeadError(message)) for fut in futures
        ]
        now = time.monotonic()
        deliveries = [
            (
                sink,
                RequestOutput(
                    rid,
                    [],
                    None,
                    True,
                    FinishReason.ERROR,
                    RequestError(ErrorKind.INTERNAL, message),
                    arrival_time=now,
                    finished_time=now,
                ),
            )
            for rid, sink in sinks.items()
        ]
        self._post(acks, deliveries)


def _deliver(
    acks: list[tuple[asyncio.Future[None], BaseException | None]],
    deliveries: list[tuple[Sink, RequestOutput]],
) -> None:
    for fut, error in acks:
        if fut.done():
            continue
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)
    for sink, out in deliveries:
        sink(out)
