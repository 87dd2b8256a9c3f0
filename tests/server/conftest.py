"""Fixtures for the server tests: a tiny chat model, a shared live server, greedy references,
one real Jaeger per session."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jaeger import Jaeger
from live_server import LiveServer, add_chat_template, make_engine

from mstar.engine.config import EngineConfig
from mstar.engine.sampling_params import SamplingParams


@pytest.fixture(scope="session")
def tiny_chat_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama plus a chat template written in its own vocabulary."""
    folder = tmp_path_factory.mktemp("tiny-chat") / "tiny-chat"
    shutil.copytree(tiny_llama_dir, folder)
    return add_chat_template(folder)


@pytest.fixture(scope="module")
def server(tiny_chat_dir: Path) -> Iterator[LiveServer]:
    """One shared server for tests that do not need special settings."""
    with LiveServer(make_engine(tiny_chat_dir)) as live:
        yield live


@pytest.fixture(scope="module")
def smol() -> Iterator[LiveServer]:
    """A server of the real SmolLM2 (the packaged default model), one per module."""
    from mstar.engine.engine import LLMEngine

    engine = LLMEngine.from_config(EngineConfig(device="cpu", num_pages=512, page_size=16))
    with LiveServer(engine) as live:
        yield live


@pytest.fixture(scope="module")
def smol_exact() -> Iterator[LiveServer]:
    """The real SmolLM2 dequantized (``quantization="none"``): greedy text repeats whatever the
    prefix cache holds. As stored, a step's kernel depends on its rows (a cached prefix turns a
    40-row prompt step into a 3-row one: 8-bit activations instead of float), so a repeated
    greedy request may differ after a near tie."""
    from mstar.engine.engine import LLMEngine

    config = EngineConfig(device="cpu", num_pages=512, page_size=16, quantization="none")
    with LiveServer(LLMEngine.from_config(config)) as live:
        yield live


@pytest.fixture(scope="session")
def reference(tiny_chat_dir: Path) -> Any:
    """Offline greedy continuation on a separate engine: prompt ids -> output ids."""
    engine = make_engine(tiny_chat_dir)

    def run(prompt: list[int], max_tokens: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return list(engine.generate([prompt], params)[0])

    return run


@pytest.fixture(scope="session")
def jaeger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jaeger]:
    """The real Jaeger (in-memory, OTLP/HTTP on loopback); tests tell theirs apart by service."""
    process = Jaeger(tmp_path_factory.mktemp("jaeger"))
    try:
        process.wait_ready()
        print(f"\nJaeger {process.version} ({process.binary}); OTLP/HTTP at {process.otlp_url}")
        yield process
    finally:
        process.stop()
