"""The adaptive step budget: a cost model fitted from step times, and the budget it implies."""

import math
import random

import pytest

from mstar.engine.step_budget import PRIOR, StepBudget, StepCostModel

TRUE = (0.008, 0.0012, 0.0003)  # base, per decode row, per prompt token (seconds)


def _seconds(decode_rows: int, prompt: int) -> float:
    return TRUE[0] + TRUE[1] * decode_rows + TRUE[2] * prompt


def _fitted(steps: int = 300, seed: int = 0) -> StepCostModel:
    model, rng = StepCostModel(), random.Random(seed)
    for _ in range(steps):
        d, p = rng.randrange(0, 33), rng.choice([0, 0, 0, 64, 128, 256, 512])
        model.observe(d, p, _seconds(d, p) * rng.uniform(0.95, 1.05))
    return model


def test_the_fit_recovers_a_linear_step_cost():
    model = _fitted()
    for got, want in zip(model.coef, TRUE, strict=True):
        assert got == pytest.approx(want, rel=0.15)
    assert model.predict(16, 256) == pytest.approx(_seconds(16, 256), rel=0.05)


def test_steps_of_one_shape_predict_that_shape_and_keep_the_rest_finite():
    """Only decode steps of 8 rows: the prompt-token cost cannot be identified, so it stays near
    its prior instead of the solve blowing up, and the observed shape is predicted exactly."""
    model = StepCostModel()
    for _ in range(100):
        model.observe(8, 0, 0.020)
    assert model.predict(8, 0) == pytest.approx(0.020, rel=0.01)
    assert model.coef[2] == pytest.approx(PRIOR[2], rel=0.05)
    assert all(math.isfinite(c) and c >= 0 for c in model.coef)


def test_one_slow_step_cannot_swing_the_fit():
    model = _fitted()
    before = model.predict(32, 0)
    model.observe(32, 0, 100 * before)  # a first call of a new GEMM shape, a busy host
    assert model.predict(32, 0) < 1.2 * before  # clipped to 2x: one step of ~33 moves it ~14%


def test_prompt_chunks_stretch_a_step_at_most_by_the_stall_factor():
    """More streams than prompts: a step with prompt chunks stays within the stall bound."""
    budget = StepBudget(cap=2048, model=_fitted())
    for decode_rows in (8, 16, 32, 48):
        tokens = budget.tokens(decode_rows, [1024] * 4)
        prompt = tokens - decode_rows
        decode_step = _seconds(decode_rows, 0)
        limit = max(budget.stall_factor * decode_step, budget.min_step_seconds)
        assert prompt >= budget.min_tokens
        assert _seconds(decode_rows, prompt) <= limit * 1.1


def _burst_mean_ttft(chunk: int, prompts: int, length: int, decoding: int) -> float:
    """Simulated: ``prompts`` prompts of ``length`` tokens prefilled FCFS in ``chunk``-token
    steps beside ``decoding`` streams, each finished prompt decoding in every later step."""
    now, done, left, ttfts = 0.0, 0, prompts * length, []
    while left > 0:
        take = min(chunk, left)
        now += _seconds(decoding + done, take)
        left -= take
        while done < prompts and (done + 1) * length <= prompts * length - left:
            done += 1
            ttfts.append(now)
    return sum(ttfts) / len(ttfts)


def test_a_burst_is_absorbed_in_mean_ttft_optimal_chunks():
    """As many requests waiting as decoding: the chunk is within a few percent of the one that
    minimises the burst's mean time to first token (simulated with the true step costs,
    finished prompts joining the decode rows), even where the stall bound would allow less."""
    budget = StepBudget(cap=8192, model=_fitted())
    for decode_rows, prompts in ((0, 32), (12, 20), (0, 8)):
        chunk = budget.tokens(decode_rows, [128] * prompts) - decode_rows
        best = min(_burst_mean_ttft(c, prompts, 128, decode_rows) for c in range(32, 4096, 16))
        assert _burst_mean_ttft(chunk, prompts, 128, decode_rows) <= best * 1.05
    stalled = budget.tokens(13, [128] * 12) - 13
    assert _seconds(13, stalled) <= budget.stall_factor * _seconds(13, 0) * 1.1


def test_a_chunk_ends_on_a_prompt_boundary_where_the_bound_allows():
    budget = StepBudget(cap=2048, model=_fitted())
    assert budget.tokens(0, [2000]) == 2000  # nobody decoding: the one prompt goes whole
    # 8 streams: the bound is ~(3 * 17.6 - 17.6) ms / 0.3 ms = ~117 tokens
    assert budget.tokens(8, [100]) == 108
    assert budget.tokens(8, [300]) < 8 + 300
    # a burst of 100-token prompts: the square-root chunk (~320) grows to the 4th prompt's end
    assert budget.tokens(0, [100] * 20) == 400


def test_the_budget_stays_within_its_floor_and_cap():
    budget = StepBudget(cap=256, model=_fitted())
    assert budget.tokens(0, [1000] * 100) == 256
    slow = StepBudget(cap=2048, min_tokens=32)
    slow.model.coef = (0.001, 0.0001, 0.01)  # prompt tokens so dear the bound allows ~4
    assert slow.tokens(40, [5000]) == 40 + 32
    assert budget.tokens(10, []) == 256
