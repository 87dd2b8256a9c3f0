"""The fault suite's fixtures: the server tests' tiny chat model, servers behind a fault switch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from server.conftest import tiny_chat_dir

from faults.harness import ACCOUNTS, FaultyServer

__all__ = ["tiny_chat_dir"]


@pytest.fixture
def faulty_server(tiny_chat_dir: Path, tmp_path: Path) -> Iterator[Callable[..., FaultyServer]]:
    """Start `mstar-engine serve` on the tiny model (extra flags as arguments), ready."""
    servers: list[FaultyServer] = []

    def start(*extra: str) -> FaultyServer:
        server = FaultyServer(tmp_path / f"server-{len(servers)}", tiny_chat_dir, *extra)
        servers.append(server)
        server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Every fault case's account of its requests, and what it measured."""
    if ACCOUNTS:
        terminalreporter.section("fault accounts")
        for line in ACCOUNTS:
            terminalreporter.write_line(line)
