"""The adaptive step budget: a cost model fitted from step times, and the budget it implies."""

import math
import random

import pytest

from mstar.engine.step_budget import PRIOR, StepBudget, StepCostModel

#: base, per decode row, per prompt token, per scored prompt row (seconds)
TRUE = (0.008, 0.0012, 0.0003, 0.0001)


def _seconds(decode_rows: int, prompt: int, scored: int = 0) -> float:
    return TRUE[0] + TRUE[1] * decode_rows + TRUE[2] * prompt + TRUE[3] * scored


def _fitted(steps: int = 300, seed: int = 0) -> StepCostModel:
    model, rng = StepCostModel(), random.Random(seed)
    for _ in range(steps):
        d, p = rng.randrange(0, 33), rng.choice([0, 0, 0, 64, 128, 256, 512])
        s = rng.choice([0, 0, p // 2, p])
        model.observe(d, p, _seconds(d, p, s) * rng.uniform(0.95, 1.05), s)
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
        tokens = budget.tokens(decode_rows, 4, pending_prompt=4096, head_prompt=1024)
        prompt = tokens - decode_rows
        decode_step = _seconds(decode_rows, 0)
        limit = max(budget.stall_factor * decode_step, budget.min_step_seconds)
        assert prompt >= budget.min_tokens
        assert _seconds(decode_rows, prompt) <= limit * 1.1


def test_a_burst_is_absorbed_in_mean_ttft_optimal_chunks():
    """A queue beside a decoding stream, far under the stall bound: the chunk is
    sqrt(P * overhead / per_token), which minimises the queue's mean wait
    (overhead + c * per_token) * (P / c + 1) / 2 over c."""
    budget = StepBudget(cap=8192, model=_fitted())
    per_token = budget.model.coef[2]
    for prompts in (8, 32, 64):
        pending = prompts * 128
        overhead = budget.model.predict(1, 0)
        chunk = budget.tokens(1, prompts, pending, head_prompt=128) - 1

        def mean_wait(c: int, pending: int = pending, overhead: float = overhead) -> float:
            return (overhead + c * per_token) * (pending / c + 1) / 2

        assert chunk == int(math.sqrt(pending * overhead / per_token))
        assert mean_wait(chunk) <= min(mean_wait(c) for c in range(32, 4096, 8)) * 1.01


def test_a_wave_is_taken_whole_up_to_the_cap():
    """Nobody decoding, or only streams the wave itself started (``wave``): the pending prompts
    go whole, up to the cap (the wave's later steps stall every stream anyway, and each extra
    step delays its last first token). The same queue beside streams already decoding is
    chunked under the stall bound."""
    budget = StepBudget(cap=2048, model=_fitted())
    assert budget.tokens(0, 8, pending_prompt=1024, head_prompt=128) == 1024
    assert budget.tokens(0, 32, pending_prompt=4096, head_prompt=128) == 2048
    assert budget.tokens(16, 16, pending_prompt=2048, head_prompt=128, wave=True) == 2048
    assert budget.tokens(4, 4, pending_prompt=512, head_prompt=128, wave=True) == 4 + 512
    chunk = budget.tokens(4, 4, pending_prompt=512, head_prompt=128) - 4
    assert 128 <= chunk < 512


def test_the_stall_streams_accept_grows_with_the_queue_per_stream():
    """With streams decoding, a step stretches to stall_factor * sqrt(waiting / decoding) decode
    steps at most: more per stream the longer the queue, never the unbounded burst chunk."""
    budget = StepBudget(cap=8192, model=_fitted())
    decode_rows, decode_step = 8, _seconds(8, 0)
    steps = []
    for per_stream in (1, 4, 16):
        prompts = decode_rows * per_stream
        chunk = budget.tokens(decode_rows, prompts, prompts * 1024, head_prompt=64) - decode_rows
        step = _seconds(decode_rows, chunk)
        assert step <= budget.stall_factor * math.sqrt(per_stream) * decode_step * 1.1
        steps.append(step)
    assert steps[0] < steps[1] < steps[2]
    absorb = int(math.sqrt(128 * 1024 * decode_step / budget.model.coef[2]))
    assert steps[2] < _seconds(decode_rows, absorb)


def test_in_a_burst_the_oldest_prompt_goes_whole_past_the_bound():
    """As many waiting as decoding: the oldest prompt is not split even where the stall bound
    would cut it; with more streams than prompts it is cut to the bound."""
    budget = StepBudget(cap=8192, model=_fitted())
    assert budget.tokens(4, 8, pending_prompt=8 * 1000, head_prompt=1000) >= 4 + 1000
    cut = budget.tokens(16, 2, pending_prompt=2 * 1000, head_prompt=1000) - 16
    assert cut < 1000
    assert _seconds(16, cut) <= budget.stall_factor * _seconds(16, 0) * 1.1


def test_the_oldest_prompt_goes_whole_when_the_bound_allows():
    budget = StepBudget(cap=2048, model=_fitted())
    assert budget.tokens(0, 1, pending_prompt=200, head_prompt=200) == 200
    # 8 streams: the bound is ~(3 * 17.6 - 17.6) ms / 0.3 ms = ~117 tokens
    assert budget.tokens(8, 1, pending_prompt=100, head_prompt=100) == 108
    assert budget.tokens(8, 1, pending_prompt=300, head_prompt=300) < 8 + 300


def test_the_budget_stays_within_its_floor_and_cap():
    budget = StepBudget(cap=256, model=_fitted())
    assert budget.tokens(0, 100, pending_prompt=100_000, head_prompt=1000) == 256
    slow = StepBudget(cap=2048, min_tokens=32)
    slow.model.coef = (0.001, 0.0001, 0.01, 0.0)  # prompt tokens so dear the bound allows ~4
    assert slow.tokens(40, 1, pending_prompt=5000, head_prompt=5000) == 40 + 32
    assert budget.tokens(10, 0, pending_prompt=0, head_prompt=0) == 256


def test_scored_prompts_get_shorter_chunks_within_the_same_stall_bound():
    """A prompt whose tokens are all scored (`prompt_logprobs`) costs per_token + per_scored a
    token: beside decoding streams its chunk shrinks so the step keeps the same bound."""
    budget = StepBudget(cap=8192, model=_fitted())
    plain = budget.tokens(16, 2, pending_prompt=2 * 1000, head_prompt=1000) - 16
    scored = budget.tokens(16, 2, 2 * 1000, head_prompt=1000, scored_share=1.0) - 16
    assert scored < plain
    limit = budget.stall_factor * _seconds(16, 0) * 1.1
    assert _seconds(16, scored, scored) <= limit
