"""The FlashInfer backend's own planning logic on CPU, with FlashInfer's wrappers replaced.

What is real here: `FlashInferPagedAttention` and `FlashInferGraphDecode` (validation, wrapper
choice, staging of the plan arrays, the wait before a re-plan, workspace sizing, FA2 pinning).
What is fake: FlashInfer's wrapper classes, which record the arrays their ``plan`` received, and
the CUDA event, which records when it is waited on. These tests show the ordering the GPU race
fix depends on (a wrapper's host arrays are never rewritten before the event recorded after the
previous plan was waited on); that the race is gone on a GPU is `tests/gpu/test_plan_race.py`'s.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from mstar.kernels.flashinfer_backend import FA_BACKEND, FlashInferPagedAttention
from mstar.kernels.flashinfer_workspace import workspace_bytes

I32 = torch.int32
SHAPE = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=4)


class Log:
    """One ordered record of plans, event records and waits, and the check done at each wait."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.planned: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def host_arrays_intact(self) -> bool:
        """Every array handed to a plan still holds what it held then (nobody rewrote it)."""
        return all(
            all(torch.equal(a, c) for a, c in zip(arrays, copies, strict=True))
            for arrays, copies in self.planned
        )


class FakeEvent:
    def __init__(self, log: Log) -> None:
        self.log = log

    def record(self) -> None:
        self.log.events.append("record")

    def synchronize(self) -> None:
        # The device would now have read every earlier plan: the host arrays must be untouched.
        assert self.log.host_arrays_intact(), "a plan's host arrays were rewritten before the wait"
        self.log.events.append("wait")
        self.log.planned.clear()


def fake_flashinfer(log: Log) -> types.ModuleType:
    class Wrapper:
        def __init__(self, workspace: torch.Tensor, layout: str, **kw: Any) -> None:
            self.workspace = workspace
            self.kw = kw
            self.kind = (
                "prefill" if self.__class__.__name__.startswith("BatchPrefill") else "decode"
            )
            self.args: list[Any] = []
            self.lens: torch.Tensor | None = None

        def plan(self, *args: Any, **kw: Any) -> None:
            # The page indices are the device copy (CPU here): FlashInfer reads the rest from
            # host memory, and copies them to the device asynchronously.
            arrays = args[:4] if self.kind == "prefill" else args[:3]
            device_arg = 2 if self.kind == "prefill" else 1
            host = [a for i, a in enumerate(arrays) if i != device_arg]
            log.planned.append((host, [a.clone() for a in host]))
            log.events.append(f"plan {self.kind}")
            self.args = list(args)
            self.plan_kw = kw
            # As FlashInfer's kv_lens buffer: grown when a step has more rows, rewritten by
            # every plan after (an inference tensor here would refuse that write).
            rows = args[0].numel()
            if self.lens is None or self.lens.numel() < rows:
                self.lens = torch.zeros(rows, dtype=I32)
            self.lens[:rows].copy_(args[0])

        def run(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return q

    mod = types.ModuleType("flashinfer")
    mod.BatchPrefillWithPagedKVCacheWrapper = type(  # type: ignore[attr-defined]
        "BatchPrefillWithPagedKVCacheWrapper", (Wrapper,), {}
    )
    mod.BatchDecodeWithPagedKVCacheWrapper = type(  # type: ignore[attr-defined]
        "BatchDecodeWithPagedKVCacheWrapper", (Wrapper,), {}
    )
    return mod


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> Log:
    log = Log()
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer(log))
    return log


def backend(log: Log) -> FlashInferPagedAttention:
    return FlashInferPagedAttention(
        "cpu", torch.bfloat16, num_sms=132, new_event=lambda: FakeEvent(log)
    )


def prefill_chunk(start: int, n: int) -> tuple[torch.Tensor, ...]:
    """One sequence's chunk of ``n`` prompt tokens after ``start`` cached ones (4-token pages)."""
    kv_len = start + n
    pages = -(-kv_len // 4)
    return (
        torch.tensor([0, n], dtype=I32),
        torch.tensor([0, pages], dtype=I32),
        torch.arange(10, 10 + pages, dtype=I32),
        torch.tensor([kv_len - 4 * (pages - 1)], dtype=I32),
    )


def decode_rows(lens: list[int]) -> tuple[torch.Tensor, ...]:
    pages = [-(-n // 4) for n in lens]
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=I32)
    return (
        torch.arange(len(lens) + 1, dtype=I32),
        indptr,
        torch.arange(int(indptr[-1]), dtype=I32) + 3,
        torch.tensor([n - 4 * (p - 1) for n, p in zip(lens, pages, strict=True)], dtype=I32),
    )


def test_consecutive_prefill_plans_wait_for_the_previous_plans_copies(log: Log) -> None:
    fi = backend(log)
    for i in range(3):  # a long prompt, three prefill-only steps in a row, nothing sampled
        fi.plan(*prefill_chunk(16 * i, 16), **SHAPE)
    assert log.events == [
        "plan prefill",
        "record",
        "wait",
        "plan prefill",
        "record",
        "wait",
        "plan prefill",
        "record",
    ]
    assert fi.staging("prefill").waits == 2
    # The last plan got the last step's arrays, from the same reused buffer as the first.
    wrapper = fi._prefill
    qo, kv_indptr, indices, last = (wrapper.args[i] for i in range(4))
    assert qo.tolist() == [0, 16] and kv_indptr.tolist() == [0, 12] and last.tolist() == [4]
    assert indices.device.type == "cpu"  # the device copy of the staged indices
    assert indices.tolist() == list(range(10, 22))


def test_a_plan_under_inference_mode_leaves_buffers_later_plans_can_write(log: Log) -> None:
    """Graph capture plans its padding steps under inference mode, steps plan outside it: what
    the first plans allocate (workspace, wrappers, FlashInfer's lazily grown buffers) must stay
    writable. The first H200 run failed every graph-on engine here."""
    fi = backend(log)
    graph = fi.graph_decode(4, 16)
    with torch.inference_mode():
        graph.plan(*decode_rows([5, 9, 1, 4]), **SHAPE)
        fi.plan(*prefill_chunk(0, 8), **SHAPE)
        fi.plan(*decode_rows([5]), **SHAPE)
    graph.plan(*decode_rows([6, 10, 2, 5]), **SHAPE)
    fi.plan(*prefill_chunk(8, 8), **SHAPE)
    fi.plan(*decode_rows([6, 3, 7]), **SHAPE)  # more rows: the decode buffer grows, then is written
    for wrapper in (fi._prefill, fi._decode, graph._wrapper):
        assert wrapper.lens is not None and not wrapper.lens.is_inference()
    assert not fi._workspace.is_inference()


def test_staging_buffer_is_reused_step_after_step(log: Log) -> None:
    fi = backend(log)
    seen = set()
    for i in range(3):
        fi.plan(*prefill_chunk(8 * i, 8), **SHAPE)
        seen.add(fi._prefill.args[0].untyped_storage().data_ptr())
    assert len(seen) == 1  # one persistent host buffer, not a fresh allocation per step


def test_each_wrapper_waits_only_for_its_own_last_plan(log: Log) -> None:
    fi = backend(log)
    fi.plan(*prefill_chunk(0, 12), **SHAPE)
    fi.plan(*decode_rows([13, 5]), **SHAPE)  # other wrapper: nothing of its own pending
    assert "wait" not in log.events
    fi.plan(*decode_rows([14, 6]), **SHAPE)
    assert fi.staging("decode").waits == 1 and fi.staging("prefill").waits == 0
    assert fi._wrappers[0] is fi._decode


def test_wrappers_use_fa2_and_one_workspace_sized_from_the_model(log: Log) -> None:
    fi = backend(log)
    graph = fi.graph_decode(64, 64 * 8)
    assert fi.workspace_bytes == 0  # sized at the first plan, when the heads are known
    fi.plan(*decode_rows([5, 9]), **SHAPE)
    assert fi.workspace_bytes == workspace_bytes(8, 2, 64, 132, 64)
    assert fi._prefill.kw["backend"] == FA_BACKEND == "fa2"
    assert fi._decode.kw == {"use_tensor_cores": True, "backend": "fa2"}
    graph.plan(*decode_rows([5] * 64), **SHAPE)
    assert graph._wrapper.workspace is fi._prefill.workspace is fi._decode.workspace
    assert graph._wrapper.kw["backend"] == "fa2" and graph._wrapper.kw["use_cuda_graph"]


def test_workspace_refuses_a_later_bigger_bucket_or_another_model(log: Log) -> None:
    fi = backend(log)
    fi.graph_decode(8, 64)
    fi.plan(*decode_rows([5]), **SHAPE)
    fi.graph_decode(4, 32)  # smaller than what the workspace was sized for: fine
    with pytest.raises(RuntimeError, match="graph bucket 16 added after"):
        fi.graph_decode(16, 64)
    with pytest.raises(ValueError, match="planned for"):
        fi.plan(*decode_rows([5]), **{**SHAPE, "num_qo_heads": 16})


def test_graph_plan_stages_into_fixed_buffers_and_waits_before_replanning(log: Log) -> None:
    fi = backend(log)
    graph = fi.graph_decode(4, 16)
    with pytest.raises(RuntimeError, match="before its first plan"):
        graph.run(torch.zeros(4, 8, 64), torch.zeros(1))
    graph.plan(*decode_rows([5, 9, 1, 4]), **SHAPE)
    graph.plan(*decode_rows([6, 10, 2, 5]), **SHAPE)
    assert graph.staging.waits == 1
    kv_indptr, indices, last = graph._wrapper.args[:3]
    assert indices.data_ptr() == graph._indices.data_ptr()  # the address a graph recorded
    assert kv_indptr.tolist() == [0, 2, 5, 6, 8] and last.tolist() == [2, 2, 2, 1]
    assert graph._indices[:8].tolist() == list(range(3, 11))
    with pytest.raises(ValueError, match="exactly 4 one-token rows, got 3"):
        graph.plan(*decode_rows([5, 9, 1]), **SHAPE)
    with pytest.raises(ValueError, match="index buffer"):
        graph.plan(*decode_rows([40, 40, 1, 1]), **SHAPE)
    with pytest.raises(ValueError, match="one-token rows"):
        graph.plan(*prefill_chunk(0, 4), **SHAPE)


def test_plan_rejects_malformed_layouts_and_run_checks_rows(log: Log) -> None:
    fi = backend(log)
    with pytest.raises(RuntimeError, match="before plan"):
        fi.run(torch.zeros(0, 8, 64), torch.zeros(1))
    qo, kv_indptr, indices, last = decode_rows([5])
    with pytest.raises(ValueError, match="kv_last_page_len"):
        fi.plan(qo, kv_indptr, indices, torch.tensor([9], dtype=I32), **SHAPE)
    fi.plan(qo, kv_indptr, indices, last, **SHAPE)
    with pytest.raises(ValueError, match="planned for 1 query rows, got 2"):
        fi.run(torch.zeros(2, 8, 64), torch.zeros(1))
    assert fi.run(torch.ones(1, 8, 64), torch.zeros(1)).shape == (1, 8, 64)
    assert fi.runs == 1


def test_float32_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no torch\.float32 kernels"):
        FlashInferPagedAttention("cpu", torch.float32, num_sms=1)


def test_sliding_windows_plan_wrappers_of_their_own_with_the_model_scale(log: Log) -> None:
    """Each window gets its (prefill, decode) pair over the shared workspace, planned with
    FlashInfer's ``window_left`` (keys before the query's own) and the model's scale; a layer
    runs on its window's wrapper; CUDA-graph decode refuses windows."""
    fi = backend(log)
    graph = fi.graph_decode(2, 16)
    fi.plan(*prefill_chunk(0, 12), **SHAPE, sm_scale=0.1, windows=frozenset({0, 8}))
    full, windowed = fi._wrappers[0], fi._wrappers[8]
    assert full is fi._prefill and windowed is not full and windowed.kind == "prefill"
    assert full.plan_kw["window_left"] == -1 and windowed.plan_kw["window_left"] == 7
    assert full.plan_kw["sm_scale"] == windowed.plan_kw["sm_scale"] == 0.1
    assert windowed.workspace is fi._prefill.workspace
    q = torch.ones(12, 8, 64)
    assert fi.run(q, torch.zeros(1), 8).shape == q.shape
    with pytest.raises(RuntimeError, match="window 4"):
        fi.run(q, torch.zeros(1), 4)
    fi.plan(*decode_rows([13]), **SHAPE, windows=frozenset({8}))
    assert fi._wrappers[8].kind == "decode" and fi._wrappers[8] is not fi._decode
    assert fi._wrappers[0] is fi._decode
    with pytest.raises(ValueError, match="sliding-window"):
        graph.plan(*decode_rows([5, 5]), **SHAPE, windows=frozenset({8}))
