"""Shared fixtures: KV debug asserts on everywhere, tiny model folders built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("MSTAR_KV_DEBUG_ASSERTS", "1")

from models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")
