"""A tensor-parallel replica's ranks: where they meet, their process groups, and the worker
processes one node's leading process starts and watches.

Ranks ``0 .. size-1`` spread evenly over ``--nnodes`` pods (``size / nnodes`` per pod, GPU
``rank % per_node`` on CUDA). Rank 0 runs the engine and the HTTP server; every other rank
runs `worker.run_worker`. On one node rank 0's process starts the others; on several, each
pod's process starts its own node's others and runs its first rank itself.

Two groups: ``compute`` (NCCL on CUDA, gloo on CPU) carries the in-step collectives, with a
timeout a live step never reaches; ``control`` (always gloo, on CPU tensors) carries the step
messages a worker waits for between steps, however long the server stays idle. A rank that
dies closes its sockets: gloo raises on the others at once (measured: ~0.1 s), which is how
a death mid-step reaches rank 0; `LocalWorkers` also watches its own processes between steps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mstar.engine.config import EngineConfig
from mstar.engine.model.tp import TPRank

log = logging.getLogger(__name__)

#: an in-step collective waits at most this long for a peer that is alive but stuck
STEP_TIMEOUT = timedelta(seconds=120)
#: a worker waits this long for the next step (an idle server sends none)
IDLE_TIMEOUT = timedelta(days=365)
#: how often `LocalWorkers` polls its processes, and a worker its parent
POLL_SECONDS = 0.2


@dataclass(frozen=True)
class Layout:
    """Where the ranks run: ``per_node`` on each of ``nnodes`` pods, this one ``node_rank``."""

    size: int
    nnodes: int
    node_rank: int

    @classmethod
    def of(cls, config: EngineConfig) -> Layout:
        return cls(config.tensor_parallel_size, config.nnodes, config.node_rank or 0)

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def first_rank(self) -> int:
        """The rank this pod's own process runs (0 on the leader)."""
        return self.node_rank * self.per_node

    def device_index(self, rank: int) -> int:
        return rank % self.per_node


def meeting_address(config: EngineConfig) -> str:
    """``--dist-init-addr`` across nodes; on one node a free loopback port."""
    if config.dist_init_addr:
        return config.dist_init_addr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@dataclass(frozen=True)
class RankGroup:
    """This process's rank and its two process groups (see the module doc)."""

    rank: int
    size: int
    compute: Any
    control: Any

    @property
    def tp(self) -> TPRank:
        return TPRank(self.rank, self.size, self.compute)

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` any rank holds (the KV page count every rank then uses)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankLayoutError(ValueError):
    """This pod cannot hold its share of the ranks (the message names the flags)."""


def check_devices(layout: Layout, device: torch.device) -> None:
    """On CUDA, one GPU per rank of this pod."""
    have = torch.cuda.device_count() if device.type == "cuda" else layout.per_node
    if have < layout.per_node:
        raise RankLayoutError(
            f"--tensor-parallel-size {layout.size} over --nnodes {layout.nnodes} runs "
            f"{layout.per_node} ranks per pod, one GPU each, but this pod has {have}"
        )


def join_group(rank: int, layout: Layout, address: str, device: torch.device) -> RankGroup:
    """Join the replica's groups as ``rank`` (blocks until every rank has joined), after
    pointing this process at its GPU, or at its share of the CPU's cores."""
    check_devices(layout, device)
    if device.type == "cuda":
        torch.cuda.set_device(layout.device_index(rank))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.per_node))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=layout.size,
        timeout=STEP_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    log.info("rank %d of %d joined at %s (%s)", rank, layout.size, address, backend)
    return RankGroup(rank, layout.size, dist.group.WORLD, control)


class LocalWorkers:
    """The worker ranks this process started on its node, each a
    ``python -m mstar.engine.parallel.worker`` process, and a thread that notices one exit."""

    def __init__(self, config: EngineConfig, ranks: range, address: str) -> None:
        env = dict(os.environ)
        # The workers import the same mstar as this process, whatever put it on sys.path.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        payload = json.dumps(dataclasses.asdict(config))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        for rank in ranks:
            cmd = [
                sys.executable, "-m", "mstar.engine.parallel.worker", "--rank", str(rank),
                "--address", address, "--parent", str(os.getpid()), "--config", payload,
            ]  # fmt: skip
            self.procs[rank] = subprocess.Popen(cmd, env=env)
            log.info("started tensor-parallel rank %d (pid %d)", rank, self.procs[rank].pid)
        #: why the replica is broken (a worker exited), or None
        self.failure: str | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._watch, name="mstar-tp-monitor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._closing and self._check() is None:
            time.sleep(POLL_SECONDS)

    def _check(self) -> str | None:
        """The failure: the first worker seen to have exited (None while all run)."""
        if self.failure is None and not self._closing:
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is not None:
                    self.failure = f"tensor-parallel rank {rank} (pid {proc.pid}) exited ({code})"
                    log.error("%s: this replica is down", self.failure)
                    break
        return self.failure

    def wait_failure(self, seconds: float) -> str | None:
        """The failure, waiting up to ``seconds`` for a dying worker's exit to be seen."""
        deadline = time.monotonic() + seconds
        while self._check() is None and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS / 4)
        return self.failure

    def kill(self) -> None:
        self._closing = True
        for proc in self.procs.values():
            proc.kill()
            proc.wait()

    def close(self, timeout: float = 10.0) -> None:
        """Wait for the workers to leave (told to by the caller), killing stragglers."""
        self._closing = True
        for proc in self.procs.values():
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def watch_parent(parent: int) -> None:
    """Exit when ``parent`` (the process that started this worker) is gone: a rank whose
    leader died serves no one (gloo usually raises first; this also covers a hung socket)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_SECONDS)
        log.error("the process that started this rank (pid %d) is gone: exiting", parent)
        os._exit(1)

    threading.Thread(target=watch, name="mstar-tp-parent", daemon=True).start()


@dataclass
class LeaderRanks:
    """Rank 0's side of a replica: its groups and the worker processes of its node."""

    group: RankGroup
    workers: LocalWorkers | None

    def failure(self) -> str | None:
        return None if self.workers is None else self.workers.failure


def start_leader(config: EngineConfig, device: torch.device) -> LeaderRanks:
    """Start this node's other ranks and join the replica as rank 0 (blocks until all ranks
    have joined, across nodes too)."""
    layout = Layout.of(config)
    check_devices(layout, device)  # before starting any process
    address = meeting_address(config)
    workers = None
    if layout.per_node > 1:
        workers = LocalWorkers(config, range(1, layout.per_node), address)
    try:
        group = join_group(0, layout, address, device)
    except BaseException:
        if workers is not None:
            workers.kill()
        raise
    return LeaderRanks(group, workers)
