"""The bf16 comparison rule the GPU tests use: exact until a near-tie, logprobs within a bound."""

from __future__ import annotations

import pytest
from greedy_compare import LOGPROB_TOL, assert_close_until_near_tie, top2_gap

from mstar.engine.outputs import TokenLogprob


def lp(token: int, logprob: float, runner_up: float) -> TokenLogprob:
    return TokenLogprob(token, logprob, ((token, logprob), (token + 1, runner_up)))


def run(*rows: list[tuple[int, float, float]]):  # type: ignore[no-untyped-def]
    return [[t for t, _, _ in r] for r in rows], [[lp(*x) for x in r] for r in rows]


REF = run([(5, -0.1, -3.0), (6, -0.5, -0.6), (7, -0.2, -4.0)], [(9, -0.3, -2.5)])


def test_identical_runs_compare_every_token() -> None:
    assert assert_close_until_near_tie(REF, REF) == (4, 0.0)


def test_a_divergence_at_a_near_tie_ends_the_comparison_of_that_prompt() -> None:
    # Token 1 of prompt 0 has a reference gap of 0.1 < NEAR_TIE: the runs may part there.
    got = run([(5, -0.12, -3.0), (8, -0.55, -0.6), (1, -9.0, -9.5)], [(9, -0.31, -2.5)])
    compared, worst = assert_close_until_near_tie(REF, got)
    assert compared == 2 and worst == pytest.approx(0.02)


def test_a_confident_divergence_fails() -> None:
    got = run([(4, -0.1, -3.0), (6, -0.5, -0.6), (7, -0.2, -4.0)], [(9, -0.3, -2.5)])
    with pytest.raises(AssertionError, match=r"prompt 0 diverges at token 0 \(5 vs 4\)"):
        assert_close_until_near_tie(REF, got)


def test_logprob_drift_beyond_the_tolerance_fails_even_with_equal_tokens() -> None:
    drift = LOGPROB_TOL + 0.05
    got = run([(5, -0.1, -3.0), (6, -0.5, -0.6), (7, -0.2, -4.0)], [(9, -0.3 - drift, -2.5)])
    with pytest.raises(AssertionError, match="prompt 1 token 0"):
        assert_close_until_near_tie(REF, got)


def test_length_mismatch_and_missing_top2_are_refused() -> None:
    short = run([(5, -0.1, -3.0)], [(9, -0.3, -2.5)])
    with pytest.raises(AssertionError, match="3 vs 1 tokens"):
        assert_close_until_near_tie(REF, short)
    with pytest.raises(ValueError, match="top 2"):
        top2_gap(TokenLogprob(5, -0.1, ((5, -0.1),)))
