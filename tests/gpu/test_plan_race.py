"""The race issue 32 found, on a GPU: a FlashInfer wrapper re-planned before the device read
its last plan.

A FlashInfer ``plan`` leaves its schedule in the wrapper's page-locked host buffer with a copy
queued behind the work already on the stream; without `plan_staging`'s wait a host running ahead
of the device rewrites that buffer for the next plan before the last plan's copy ran. A real
model keeps the device busy for milliseconds per step; the tiny test models do not, so each
plan here first queues ~10 ms of busy device work (``torch.cuda._sleep``), and the tests count
the re-plans at which the previous plan's copy had indeed not run yet (the race's precondition).

- Kernel level: alternating batches of 4 and 9 decode rows, one plan and run each, behind the
  lag. With the wait every output matches the torch backend; the control, the same sequence with
  the wait switched off, must count the host ahead and see an output go wrong, so the hazard is
  known to be real in this FlashInfer (on the H200: ahead at 7 of 8 re-plans, 7 outputs wrong).
- Engine level: long prompts under a 32-token step budget make many prefill-only steps in a row.
  The lagging run must equal, token and log-probability, the same engine without the lag: same
  kernels, same batches.

The engine-level run has not reproduced the race on the H200: the host was ahead at 0 of 46
re-plans, both with the sampler's index tensors as blocking copies and after they stopped
blocking, though torch's sync debug mode finds no waiting call in prefill-only steps
(``sync_points.py``); what holds the host back there is not known yet. That is why the control
is at the kernel level; the engine-level test still checks that the lag changes nothing.
``first_run.sh`` runs the control alone and last: garbled attention could fault the device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from cuda_testing import (
    KERNEL_SHAPE,
    build_hd64_llama,
    cuda_decode_case,
    cuda_engine,
    needs_cuda,
    needs_flashinfer,
    torch_attention,
)
from greedy_compare import Logprobs, Tokens, drive

from mstar.engine.engine import LLMEngine
from mstar.engine.resource_keys import ATTN
from mstar.engine.sampling_params import SamplingParams
from mstar.kernels import FlashInferPagedAttention
from mstar.kernels.plan_staging import PlanStaging

pytestmark = [needs_cuda, needs_flashinfer]

#: ~10 ms of device work queued before every plan
LAG_CYCLES = 20_000_000
STEP_BUDGET = 32
PROMPTS = [[3 + (i * 11 + j * 5) % 90 for j in range(n)] for i, n in enumerate([420, 380, 455])]
NEW = 8
PARAMS = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=2)
#: decode batches of 4 and 9 rows: plans of different layouts, alternated
ROWS = ([37, 200, 5, 64], [600, 2, 90, 250, 17, 31, 129, 400, 8])


class ReplanWatch:
    """Counts re-plans, and those at which the previous plan's copies had not run yet (the host
    was ahead of the device: the race's precondition); ``wait=False`` switches the fix off."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, wait: bool) -> None:
        self.replans = self.ahead = 0
        original = PlanStaging.wait

        def watched(staging: PlanStaging) -> None:
            if staging._pending:
                self.replans += 1
                self.ahead += not staging._event.query()  # type: ignore[attr-defined]
            if wait:
                original(staging)

        monkeypatch.setattr(PlanStaging, "wait", watched)


def _lag_every_plan(backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = backend.plan

    def lagging_plan(*args: object, **kwargs: object) -> None:
        torch.cuda._sleep(LAG_CYCLES)
        plan(*args, **kwargs)

    monkeypatch.setattr(backend, "plan", lagging_plan)


def _alternating_runs(
    monkeypatch: pytest.MonkeyPatch, steps: int = 8
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(FlashInfer's output, the torch backend's) for ``steps`` plans and runs behind the lag,
    the batch layout alternating."""
    fi = FlashInferPagedAttention("cuda", torch.bfloat16)
    cases = [cuda_decode_case(ROWS[i % 2], seed=i) for i in range(steps)]
    fi.plan(*cases[0][2], **KERNEL_SHAPE)  # compile and size outside the lagged sequence
    fi.run(cases[0][1], cases[0][0])
    torch.cuda.synchronize()
    _lag_every_plan(fi, monkeypatch)
    outs = []
    for pool, q, plan in cases:
        fi.plan(*plan, **KERNEL_SHAPE)
        outs.append(fi.run(q, pool))
    torch.cuda.synchronize()
    return [
        (out.float(), torch_attention(pool, q, plan).float())
        for out, (pool, q, plan) in zip(outs, cases, strict=True)
    ]


def _wrong(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """The steps whose output is not the reference's within bf16 rounding."""
    tol = dict(atol=2e-2, rtol=2e-2)
    return [i for i, (out, ref) in enumerate(pairs) if not torch.allclose(out, ref, **tol)]


def test_alternating_plans_on_a_lagging_device_match_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    watch = ReplanWatch(monkeypatch, wait=True)
    wrong = _wrong(_alternating_runs(monkeypatch))
    print(f"kernel level: {watch.replans} re-plans, the host ahead at {watch.ahead}")
    assert wrong == []


def test_control_without_the_wait_alternating_plans_go_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    watch = ReplanWatch(monkeypatch, wait=False)
    wrong = _wrong(_alternating_runs(monkeypatch))
    print(f"control: {watch.replans} re-plans, the host ahead at {watch.ahead}; wrong {wrong}")
    assert watch.ahead > 0, "the host never ran ahead: the lag did not set the race up"
    assert wrong, "re-plans rewrote host buffers the device had not read, yet nothing went wrong"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hd64_llama(tmp_path_factory.mktemp("race-llama"))


def _engine(folder: Path) -> LLMEngine:
    """FlashInfer with graphs, a fixed 32-token step budget (the same steps however long each
    one takes, so a lagged run can be compared with an unlagged one exactly)."""
    return cuda_engine(
        folder,
        page_size=16,
        attention_backend="flashinfer",
        max_num_batched_tokens=STEP_BUDGET,
        step_budget="fixed",
    )


def test_chunked_prefill_on_a_lagging_device_equals_the_unlagged_run(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = drive(_engine(model_dir), PROMPTS, PARAMS)
    engine = _engine(model_dir)
    backend = engine.runner.resources[ATTN].backend  # type: ignore[attr-defined]
    assert isinstance(backend, FlashInferPagedAttention)
    watch = ReplanWatch(monkeypatch, wait=True)
    _lag_every_plan(backend, monkeypatch)
    sampled: list[bool] = []
    execute = engine.model_runner.execute

    def recording(batch: Any, *prev: Any) -> Any:
        sampled.append(bool(batch.sample_rows))
        return execute(batch, *prev)

    monkeypatch.setattr(engine.model_runner, "execute", recording)
    got: tuple[Tokens, Logprobs] = drive(engine, PROMPTS, PARAMS)
    streak = longest = 0
    for s in sampled:
        streak = 0 if s else streak + 1
        longest = max(longest, streak)
    print(
        f"engine: {len(sampled)} steps, longest prefill-only run {longest}, "
        f"{watch.replans} re-plans, the host ahead at {watch.ahead}"
    )
    assert longest >= 10  # many plans in a row with nothing sampled
    assert got == reference  # same kernels, same steps: every token and log-probability
