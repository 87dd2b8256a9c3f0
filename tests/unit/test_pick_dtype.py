"""`--dtype auto` follows the CPU's bf16 support; explicit dtypes are honoured as given."""

from __future__ import annotations

import pytest
import torch

from mstar.engine import engine


@pytest.mark.parametrize(("native_bf16", "want"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_cpu_follows_native_bf16(monkeypatch, native_bf16, want):
    monkeypatch.setattr(engine, "cpu_has_bf16", lambda: native_bf16)
    assert engine._pick_dtype("auto", torch.device("cpu")) == want


def test_auto_on_cuda_is_bf16(monkeypatch):
    monkeypatch.setattr(engine, "cpu_has_bf16", lambda: False)
    assert engine._pick_dtype("auto", torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_explicit_dtype_wins(monkeypatch, name):
    monkeypatch.setattr(engine, "cpu_has_bf16", lambda: True)
    assert engine._pick_dtype(name, torch.device("cpu")) == getattr(torch, name)
