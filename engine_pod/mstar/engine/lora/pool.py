"""`LoraPool`: the registered adapters and the resident slots they are loaded into.

Slots are a fixed pool (``--max-loras``) like KV pages: an adapter is loaded into a free slot,
or into the slot of the least recently used adapter that no admitted request holds (an
eviction); an adapter that admitted requests hold is never evicted. Loads run on one worker
thread (reading the PEFT folder and writing the slot's weights), so the engine loop keeps
stepping the other requests meanwhile; the adapter becomes resident when its load lands.

Thread use: the engine thread admits and releases, the worker lands loads, the server
registers and unregisters adapters; one lock guards the tables.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from mstar.engine.lora.adapter import AdapterError, LoraAdapter

log = logging.getLogger(__name__)

#: reads and checks an adapter folder: (name, path) -> weights (`adapter.load_adapter`)
Reader = Callable[[str, str], LoraAdapter]
#: writes an adapter's weights into a slot (None: clears it)
Writer = Callable[[int, LoraAdapter | None], None]


class UnknownAdapter(KeyError):
    """No adapter is registered under this name (a 404 naming it)."""


@dataclass
class PoolCounters:
    """Cumulative counts exported as ``mstar:lora_*_total``."""

    loads: int = 0
    evictions: int = 0
    load_failures: int = 0
    refusals: Counter[str] = field(default_factory=Counter)
    #: requests that named each adapter (only registered names reach the engine)
    requests: Counter[str] = field(default_factory=Counter)


class LoraPool:
    """Registered adapters (name -> folder) and ``slots`` resident ones."""

    def __init__(self, slots: int, reader: Reader, writer: Writer) -> None:
        self.num_slots = slots
        self._read = reader
        self._write = writer
        self._lock = threading.Lock()
        self.paths: dict[str, str] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # LRU first
        self.loading: dict[str, tuple[int, Future[None]]] = {}
        self.failed: dict[str, str] = {}
        self.pins: Counter[str] = Counter()
        self.free = list(range(slots - 1, -1, -1))
        self.counters = PoolCounters()
        #: each registration's number: a name served again (another folder) is a new chain
        self._registrations = itertools.count(1)
        self._registration: dict[str, int] = {}
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="mstar-lora-load")

    # -- registry (server) -----------------------------------------------------------------------
    def register(self, name: str, path: str) -> None:
        """Check the folder now (a bad one raises `AdapterError`), serve it from now on."""
        with self._lock:
            if name in self.paths:
                raise AdapterError(f"the LoRA adapter {name!r} is already loaded", "lora_name")
        self._read(name, path)
        with self._lock:
            self.paths[name] = path
            self._registration[name] = next(self._registrations)
            self.failed.pop(name, None)

    def unregister(self, name: str) -> None:
        """Stop serving ``name``; its slot is freed now, or when its last request ends."""
        with self._lock:
            if name not in self.paths:
                raise UnknownAdapter(name)
            del self.paths[name]
            self.failed.pop(name, None)
            self._drop_if_idle(name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self.paths)

    def cache_salt(self, name: str) -> bytes:
        """The prefix-cache chain root of ``name``'s requests (`KVRequestConfig.cache_salt`):
        one per registration, so no two adapters, and no adapter and the base, share KV."""
        return f"lora:{name}:{self._registration[name]}".encode()

    def known(self, name: str) -> bool:
        return name in self.paths

    # -- slots (engine thread) -------------------------------------------------------------------
    def status(self, name: str) -> str:
        """ "resident", "loading", "failed" or "absent"."""
        if name in self.resident:
            return "resident"
        if name in self.loading:
            return "loading"
        return "failed" if name in self.failed else "absent"

    def try_pin(self, name: str) -> bool:
        """An admitted request holds ``name`` if it is registered and resident (True): it is
        never evicted until `unpin`."""
        with self._lock:
            if name not in self.resident or name not in self.paths:
                return False
            self.pins[name] += 1
            self.resident.move_to_end(name)
            return True

    def unpin(self, name: str) -> None:
        with self._lock:
            self.pins[name] -= 1
            if self.pins[name] <= 0:
                del self.pins[name]
                if name not in self.paths:
                    self._drop_if_idle(name)

    def slot(self, name: str) -> int:
        return self.resident[name]

    def start_load(self, name: str) -> bool:
        """Begin loading ``name`` into a free slot or an idle adapter's (evicting it); False
        when every slot holds an adapter with admitted requests or a load in flight."""
        with self._lock:
            if name in self.loading or name in self.resident:
                return True
            slot = self.free.pop() if self.free else self._evict_idle()
            if slot is None:
                return False
            self.counters.loads += 1
            future: Future[None] = Future()
            self.loading[name] = (slot, future)
            path = self.paths[name]
        self._worker.submit(self._load, name, path, slot, future)
        return True

    def _evict_idle(self) -> int | None:
        for victim in self.resident:  # least recently used first
            if self.pins[victim] == 0:
                self.counters.evictions += 1
                log.info("LoRA adapter %s evicted from slot %d", victim, self.resident[victim])
                return self.resident.pop(victim)
        return None

    def _load(self, name: str, path: str, slot: int, future: Future[None]) -> None:
        try:
            self._write(slot, self._read(name, path))
        except Exception as exc:  # a folder changed since registration: its requests fail
            log.warning("LoRA adapter %s failed to load: %s", name, exc)
            with self._lock:
                self.loading.pop(name, None)
                self.free.append(slot)
                self.failed[name] = str(exc)
                self.counters.load_failures += 1
            future.set_result(None)
            return
        with self._lock:
            self.loading.pop(name, None)
            if name in self.paths:
                self.resident[name] = slot
            else:  # unregistered while loading
                self.free.append(slot)
        log.info("LoRA adapter %s loaded into slot %d", name, slot)
        future.set_result(None)

    def _drop_if_idle(self, name: str) -> None:
        if self.pins[name] == 0 and name in self.resident:
            self.free.append(self.resident.pop(name))

    def wait_loads(self, timeout: float | None = None) -> None:
        """Block until the loads in flight land (tests and the warm-up at start)."""
        with self._lock:
            futures = [f for _, f in self.loading.values()]
        for f in futures:
            f.result(timeout)

    def snapshot(self) -> tuple[list[str], list[str], Counter[str]]:
        """(registered names, resident names, pins), copied under the lock (metrics)."""
        with self._lock:
            return list(self.paths), list(self.resident), Counter(self.pins)

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
