"""Fixtures every unit test file used to copy.

`kv_debug_asserts` (autouse): the KV cache checks page conservation after every mutation in
every unit test, whatever the environment says (the root conftest only sets a default).
`one_thread`: torch on one thread for the test; the shared 2-core test host makes OpenMP
threads spin against each other. Files that want it say
``pytestmark = pytest.mark.usefixtures("one_thread")``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def kv_debug_asserts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSTAR_KV_DEBUG_ASSERTS", "1")


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
