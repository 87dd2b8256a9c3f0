"""Sampling statistics: filters never leak mass, and draws follow the target distribution.

Every resource here has a fixed engine seed (and seeded rows fixed seeds), so the statistics
are deterministic: a pass is not luck, and a bug shifts them far past the thresholds.
"""

from __future__ import annotations

import torch

from mstar.engine.resources.sampling import SamplerRequestConfig, SamplerResource
from mstar.engine.resources.step import ResourceStep, Segment, StepContext
from mstar.engine.sampling_params import SamplingParams

PROBS = [0.1, 0.2, 0.3, 0.4]
#: chi-square critical value, 3 degrees of freedom, p = 0.001.
CHI2_3DOF_999 = 16.27


def draw_counts(
    params: list[SamplingParams], probs: list[float], steps: int, engine_seed: int = 0
) -> list[int]:
    """Run `steps` committed steps over one row per params, counting tokens over all draws."""
    vocab = len(probs)
    res = SamplerResource(vocab, seed=engine_seed, initial_capacity=len(params) + 1)
    rids = [f"r{i}" for i in range(len(params))]
    for rid, p in zip(rids, params, strict=True):
        res.ingest_request(rid, SamplerRequestConfig(p))
    step = ResourceStep(segments=tuple(Segment(r, "main", 1) for r in rids))
    ctx = StepContext(request_ids=rids, graph_walk="decode", slot=0, capture=False)
    logits = torch.tensor(probs).log().expand(len(rids), vocab).contiguous()
    counts = [0] * vocab
    for _ in range(steps):
        for tok in res.sample(res.plan(step, ctx), logits).token_ids:
            counts[tok] += 1
        res.commit(step, ctx)
    return counts


def chi2(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


def normalised(weights: list[float]) -> list[float]:
    s = sum(weights)
    return [w / s for w in weights]


def test_temperature_one_matches_the_distribution() -> None:
    counts = draw_counts([SamplingParams()] * 2000, PROBS, steps=10)
    assert sum(counts) == 20000
    assert chi2(counts, PROBS) < CHI2_3DOF_999, counts


def test_seeded_draws_match_the_distribution() -> None:
    # 20000 distinct seeds, one step each: the counter-hash noise must be a fair Gumbel.
    params = [SamplingParams(seed=s) for s in range(20000)]
    counts = draw_counts(params, PROBS, steps=1)
    assert chi2(counts, PROBS) < CHI2_3DOF_999, counts


def test_seeded_draws_over_one_requests_outputs_match_the_distribution() -> None:
    # One seed per row, many output indices: successive draws of a request are independent.
    params = [SamplingParams(seed=1000 + s) for s in range(40)]
    counts = draw_counts(params, PROBS, steps=500)
    assert chi2(counts, PROBS) < CHI2_3DOF_999, counts


def test_temperature_half_squares_the_distribution() -> None:
    target = normalised([p**2 for p in PROBS])
    counts = draw_counts([SamplingParams(temperature=0.5)] * 2000, PROBS, steps=10)
    assert chi2(counts, target) < CHI2_3DOF_999, counts


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = [0.05, 0.5, 0.15, 0.3]  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    # p = 0.7: {1, 3} reaches 0.8; p = 0.8 exactly: {1, 3} still suffices (sum is 0.8).
    for p in (0.7, 0.8):
        counts = draw_counts([SamplingParams(top_p=p, seed=s) for s in range(4000)], probs, 1)
        assert counts[0] == 0 and counts[2] == 0, (p, counts)
        # Renormalised over the kept set: 0.5 : 0.3.
        assert abs(counts[1] / 4000 - 0.625) < 0.03, (p, counts)
    # Exact boundaries whose float32 partial sums land just below p still stop there.
    for p, banned in ((0.7, (0, 1)), (0.9, (0,))):
        counts = draw_counts([SamplingParams(top_p=p)] * 3000, PROBS, 1)
        assert all(counts[t] == 0 for t in banned), (p, counts)
        assert all(counts[t] > 0 for t in range(4) if t not in banned), (p, counts)
    # p = 0.85 needs token 2 as well, never token 0.
    counts = draw_counts([SamplingParams(top_p=0.85)] * 4000, probs, 1)
    assert counts[0] == 0 and counts[2] > 0
    assert chi2(counts[1:], normalised([0.5, 0.15, 0.3])) < 13.8, counts  # 2 dof, p = 0.001


def test_min_p_filters_below_fraction_of_max() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]  # min_p = 0.25 -> cut at 0.125: token 3 goes
    counts = draw_counts([SamplingParams(min_p=0.25)] * 4000, probs, 1)
    assert counts[3] == 0 and min(counts[:3]) > 0
    kept = normalised(probs[:3])
    assert chi2(counts[:3], kept) < 13.8, counts  # 2 dof, p = 0.001
    # min_p = 0.5 keeps exactly tokens at >= 0.25: only 0 and 1.
    counts = draw_counts([SamplingParams(min_p=0.5)] * 2000, probs, 1)
    assert counts[2] == counts[3] == 0 and counts[1] > 0


def test_top_p_applies_to_the_top_k_renormalised_distribution() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    # top_k = 2 keeps {3: 0.4, 2: 0.3}, renormalised to 0.571 / 0.429; top_p = 0.55 is then
    # reached by token 3 alone (over the raw distribution it would also need token 2).
    counts = draw_counts([SamplingParams(top_k=2, top_p=0.55)] * 2000, probs, 1)
    assert counts == [0, 0, 0, 2000]
    counts = draw_counts([SamplingParams(top_k=3, top_p=0.8)] * 3000, probs, 1)
    # top_k = 3 renormalises to 0.444 / 0.333 / 0.222: 0.8 needs all three, token 0 never.
    assert counts[0] == 0 and min(counts[1:]) > 0


def test_chi2_would_catch_a_wrong_distribution() -> None:
    # The statistic separates the target from a plausible bug (uniform, or temperature ignored).
    counts = draw_counts([SamplingParams(temperature=0.5)] * 2000, PROBS, steps=10)
    assert chi2(counts, PROBS) > 10 * CHI2_3DOF_999
    assert chi2(counts, normalised([1.0] * 4)) > 10 * CHI2_3DOF_999
