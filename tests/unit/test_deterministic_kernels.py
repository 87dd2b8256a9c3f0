"""``--deterministic``'s kernels, bitwise: a row's GEMM output, a position's attention and a tiny
model's logits do not depend on the batch or on how a sequence was split into steps (bf16 on
the C++ CPU kernels); and every refusal of the mode. The engine-level claims on the real model
are `tests/engine/test_deterministic.py`'s."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from mstar_model_testutil import PagedPool
from paged_cases import decode_case

from mstar.engine.deterministic import (
    DeterministicUnavailable,
    check_head_dim,
    deterministic_setup,
)
from mstar.engine.model import load_model
from mstar.kernels import TorchPagedAttention, cpu_kernels
from mstar.kernels.cpu_gemm import PackedLinear, deterministic_kernel
from mstar.kernels.flashinfer_backend import FlashInferPagedAttention

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = torch.bfloat16


def kernels() -> Any:
    k = cpu_kernels.load()
    assert k is not None and deterministic_kernel(k) is not None, "the kernels must build here"
    return k


@pytest.mark.parametrize(("k", "n", "bias"), [(64, 96, False), (75, 40, True), (576, 960, True)])
def test_gemm_row_bits_do_not_depend_on_the_batch(k: int, n: int, bias: bool) -> None:
    """Every row of any batch (1 to 700 rows: both sides of every default row limit) equals
    the same row multiplied alone, bit for bit; the default layer's rows need not."""
    gen = torch.Generator().manual_seed(k)
    linear = torch.nn.Linear(k, n, bias=bias, dtype=BF16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.1)
        if bias:
            linear.bias.copy_(torch.randn(n, generator=gen))
    layer = PackedLinear(linear, kernels=kernels(), deterministic=True)
    assert layer.packed_weight.numel() == 0  # no oneDNN copy: nothing would read it
    x = torch.randn(700, k, generator=gen).to(BF16)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(0, 700, 37)])
    for rows in (1, 6, 13, 129, 700):
        out = layer(x[:rows])
        assert torch.equal(out, layer(x[:rows].contiguous()))
        picked = list(range(0, rows, 37))
        assert torch.equal(out[picked], alone[: len(picked)])
    ref = x.float() @ linear.weight.float().T + (linear.bias.float() if bias else 0)
    torch.testing.assert_close(layer(x).float(), ref, atol=0.05, rtol=0.02)


def attend(backend: TorchPagedAttention, pool: torch.Tensor, q: torch.Tensor, plan: Any) -> Any:
    backend.plan(
        *plan,
        num_qo_heads=q.shape[1],
        num_kv_heads=pool.shape[3],
        head_dim=q.shape[2],
        page_size=pool.shape[2],
    )
    return backend.run(q, pool)


def chunk_plan(pages: list[int], page_size: int, start: int, n: int) -> tuple[torch.Tensor, ...]:
    """One sequence's queries start .. start + n over its first start + n keys."""
    kv = start + n
    used = -(-kv // page_size)
    i32 = torch.int32
    return (
        torch.tensor([0, n], dtype=i32),
        torch.tensor([0, used], dtype=i32),
        torch.tensor(pages[:used], dtype=i32),
        torch.tensor([kv - (used - 1) * page_size], dtype=i32),
    )


@pytest.mark.parametrize("head_dim", [64, 32])
def test_attention_bits_same_in_prompt_chunk_and_decode(head_dim: int) -> None:
    """A 45-token sequence's 45 positions attended as one prompt, as chunks of 7, one by one
    (decode) and inside a batch with other sequences: the same bits every way in deterministic
    mode; the default backend's prompt and decode kernels differ (head dim 64)."""
    n, ps = 45, 4
    pool, _, _, plan = decode_case(
        [n, 30, 9], page_size=ps, heads=(6, 2, head_dim), seed=5, dtype=BF16
    )
    pages = plan[2][: int(plan[1][1])].tolist()
    q = torch.randn(n, 6, head_dim, generator=torch.Generator().manual_seed(1)).to(BF16)
    det = TorchPagedAttention(deterministic=True)
    whole = attend(det, pool, q, chunk_plan(pages, ps, 0, n))
    chunks = torch.cat(
        [
            attend(det, pool, q[s : s + 7], chunk_plan(pages, ps, s, min(7, n - s)))
            for s in range(0, n, 7)
        ]
    )
    steps = torch.cat(
        [attend(det, pool, q[s : s + 1], chunk_plan(pages, ps, s, 1)) for s in range(n)]
    )
    assert torch.equal(whole, chunks) and torch.equal(whole, steps)
    other = torch.randn(2, 6, head_dim, generator=torch.Generator().manual_seed(2)).to(BF16)
    # A mixed step: sequences 1 and 2 of the case decode, sequence 0's positions 20..44 after.
    idx = plan[2].tolist()
    p0, p1, p2 = (
        idx[: int(plan[1][1])],
        idx[int(plan[1][1]) : int(plan[1][2])],
        idx[int(plan[1][2]) :],
    )
    mixed_plan = (
        torch.tensor([0, 1, 2, 27], dtype=torch.int32),
        torch.tensor(
            [0, len(p1), len(p1) + len(p2), len(p1) + len(p2) + len(p0)], dtype=torch.int32
        ),
        torch.tensor(p1 + p2 + p0, dtype=torch.int32),
        torch.tensor([int(plan[3][1]), int(plan[3][2]), int(plan[3][0])], dtype=torch.int32),
    )
    mixed = attend(det, pool, torch.cat([other, q[20:]]), mixed_plan)
    assert torch.equal(mixed[2:], whole[20:])
    default = TorchPagedAttention()
    d_whole = attend(default, pool, q, chunk_plan(pages, ps, 0, n))
    torch.testing.assert_close(whole.float(), d_whole.float(), atol=0.02, rtol=0.02)
    if head_dim == 64:  # SmolLM2's (at 32 the outputs' bf16 rounding hid the differences)
        # The default prompt and decode kernels differ for some queries (which ones depends on
        # the ISA level the session loaded): what the deterministic mode exists for.
        differ = []
        for seed in (1, 2, 3):
            qs = torch.randn(n, 6, head_dim, generator=torch.Generator().manual_seed(seed))
            qs = qs.to(BF16)
            d_whole = attend(default, pool, qs, chunk_plan(pages, ps, 0, n))
            d_steps = torch.cat(
                [
                    attend(default, pool, qs[s : s + 1], chunk_plan(pages, ps, s, 1))
                    for s in range(n)
                ]
            )
            differ.append(not torch.equal(d_whole, d_steps))
        assert any(differ)


def test_tiny_model_logits_same_bits_however_the_steps_split(tmp_path: Path) -> None:
    """A tiny random Llama (bf16, deterministic): one sequence's logits at every position are the
    same bits computed as one prompt, as chunks of 5 then decode, and inside mixed steps with
    other sequences (prompt chunks and decode rows of varying sizes)."""
    from models import build_tiny_model

    folder = build_tiny_model(tmp_path, "llama", hidden_size=128, intermediate_size=256)
    decoder, cfg, _ = load_model(folder, "bfloat16", deterministic=True)
    seq = [int(t) for t in torch.randint(3, 90, (40,), generator=torch.Generator().manual_seed(0))]

    def pool() -> PagedPool:
        return PagedPool(
            cfg,
            num_pages=64,
            page_size=4,
            dtype=BF16,
            backend=TorchPagedAttention(deterministic=True),
        )

    whole = pool().step(decoder, [(0, seq)], all_logits=True)
    p = pool()
    split = [p.step(decoder, [(0, seq[:5])], all_logits=True)]
    split += [p.step(decoder, [(0, seq[s : s + 5])], all_logits=True) for s in range(5, 20, 5)]
    split += [p.step(decoder, [(0, [t])], all_logits=True) for t in seq[20:]]
    assert torch.equal(torch.cat(split), whole)
    p = pool()
    p.step(decoder, [(1, seq[::-1]), (2, seq[:3])])
    mixed = [p.step(decoder, [(1, [7]), (0, seq[:17]), (2, seq[3:30])], all_logits=True)[1:18]]
    for t in seq[17:]:
        mixed.append(p.step(decoder, [(2, [9]), (0, [t]), (1, [4, 5, 6])])[1:2])
    assert torch.equal(torch.cat(mixed), whole)


def test_refusals() -> None:
    """Every way the mode refuses, each with its reason."""
    f32 = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="bf16 only"):
        PackedLinear(f32, kernels=kernels(), deterministic=True)
    with pytest.raises(ValueError, match="VDPBF16PS or FMA"):
        PackedLinear(torch.nn.Linear(8, 8, dtype=BF16), kernels=None, deterministic=True)
    with pytest.raises(ValueError, match="C\\+\\+ CPU kernels"):
        TorchPagedAttention(use_kernels=False, deterministic=True)
    det = TorchPagedAttention(deterministic=True)
    one = [torch.tensor(v, dtype=torch.int32) for v in ([0, 1], [0, 1], [0], [1])]
    with pytest.raises(ValueError, match="head_dim 8"):
        det.plan(*one, num_qo_heads=2, num_kv_heads=2, head_dim=8, page_size=4)
    det.plan(*one, num_qo_heads=2, num_kv_heads=2, head_dim=16, page_size=4)
    with pytest.raises(ValueError, match="float32 or bf16"):
        det.run(
            torch.zeros(1, 2, 16, dtype=torch.float16),
            torch.zeros(1, 2, 4, 2, 16, dtype=torch.float16),
        )
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(DeterministicUnavailable, match="--dtype bfloat16"):
        deterministic_setup(cpu, torch.float32, "torch")
    with pytest.raises(DeterministicUnavailable, match="--attention-backend flashinfer"):
        deterministic_setup(cuda, BF16, "torch")
    with pytest.raises(DeterministicUnavailable, match="head_dim 8"):
        check_head_dim(cpu, 8)
    check_head_dim(cuda, 8)  # FlashInfer's concern there, not the CPU kernel's
    deterministic_setup(cpu, BF16, "torch")


def test_refused_without_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    with pytest.raises(DeterministicUnavailable, match="MSTAR_CPU_KERNELS=0"):
        deterministic_setup(torch.device("cpu"), BF16, "torch")


def fake_flashinfer(split_option: bool, calls: list[dict[str, Any]]) -> types.ModuleType:
    """FlashInfer's two wrappers, recording each plan's keyword arguments; ``split_option``:
    whether their ``plan`` takes ``disable_split_kv`` (FlashInfer 0.3+)."""

    class Wrapper:
        def __init__(self, *args: Any, **kw: Any) -> None:
            pass

        if split_option:

            def plan(self, *args: Any, disable_split_kv: bool = False, **kw: Any) -> None:
                calls.append(dict(kw, disable_split_kv=disable_split_kv))

        else:

            def plan(self, *args: Any, causal: bool = False, **kw: Any) -> None:
                calls.append(kw)

    mod = types.ModuleType("flashinfer")
    for name in ("BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper"):
        setattr(mod, name, type(name, (Wrapper,), {}))
    return mod


def test_flashinfer_plans_without_split_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic FlashInfer passes ``disable_split_kv=True`` to every plan (prefill, decode,
    CUDA-graph decode); the default passes nothing; an old FlashInfer is refused. (FlashInfer's
    wrappers are fakes here: no GPU. Whether the kernels then give batch-invariant bits on a GPU
    is unverified.)"""
    calls: list[dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer(True, calls))
    shape = dict(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=4)
    prefill = [torch.tensor(v, dtype=torch.int32) for v in ([0, 3], [0, 1], [5], [3])]
    decode = [torch.tensor(v, dtype=torch.int32) for v in ([0, 1], [0, 1], [5], [3])]
    for det in (True, False):
        calls.clear()
        fi = FlashInferPagedAttention(
            "cpu",
            BF16,
            num_sms=4,
            deterministic=det,
            new_event=lambda: types.SimpleNamespace(record=lambda: None, synchronize=lambda: None),
        )
        graph = fi.graph_decode(1, 4)
        fi.plan(*prefill, **shape)
        fi.plan(*decode, **shape)
        graph.plan(*decode, **shape)
        assert [c["disable_split_kv"] for c in calls] == [det] * 3
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer(False, calls))
    with pytest.raises(ValueError, match="no disable_split_kv"):
        FlashInferPagedAttention("cpu", BF16, num_sms=4, deterministic=True)
    FlashInferPagedAttention("cpu", BF16, num_sms=4)


def test_serve_refuses_float32_with_a_message() -> None:
    """``mstar-engine serve --deterministic --dtype float32`` on CPU exits 2, naming the fix,
    before loading any weight."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mstar.engine.cli",
            "serve",
            "--deterministic",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--model",
            "/nonexistent",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--deterministic on CPU runs bf16 kernels only" in proc.stderr
    assert "use --dtype bfloat16" in proc.stderr
