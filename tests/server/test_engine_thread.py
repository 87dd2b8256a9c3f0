"""The server steps its engine on the thread that built it (one OpenMP team, not two)."""

from __future__ import annotations

import threading
from pathlib import Path

import openai
import pytest
from live_server import LiveServer, make_engine

from mstar.engine.model.config import ModelLoadError
from mstar.engine.server.async_engine import EngineThread


def test_steps_run_on_the_thread_that_built_the_engine(tiny_chat_dir: Path) -> None:
    home = EngineThread()
    built_on: list[int] = []

    def build() -> object:
        built_on.append(threading.get_ident())
        return make_engine(tiny_chat_dir)

    engine = home.call(build)
    stepped_on: set[int] = set()
    real_step = engine.step

    def step() -> list:
        stepped_on.add(threading.get_ident())
        return real_step()

    engine.step = step
    with LiveServer(engine, engine_thread=home) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x")
        out = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4)
        assert out.usage is not None and out.usage.completion_tokens == 4
    assert built_on and built_on[0] != threading.get_ident()
    assert stepped_on == {built_on[0]}
    home.join(10)
    assert not home.is_alive(), "the engine thread outlived the server"


def test_a_failed_build_raises_to_the_caller(tmp_path: Path) -> None:
    home = EngineThread()

    def build() -> object:
        return make_engine(tmp_path / "missing")

    with pytest.raises(ModelLoadError):
        home.call(build)
    assert home.call(lambda: 42) == 42  # the thread survives a failed job
    home.close()
    home.join(10)
    assert not home.is_alive()
