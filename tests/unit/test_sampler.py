"""SamplerResource: greedy/filters/penalties/logprobs semantics, state lifecycle, seeding."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from mstar.engine.resources.sampling import (
    GREEDY_EPS,
    SampleOutput,
    SamplerPlan,
    SamplerRequestConfig,
    SamplerResource,
)
from mstar.engine.resources.step import ResourceStep, Segment, StepContext
from mstar.engine.sampling_params import SamplingParams

V = 32
GREEDY_TINY = 1e-6  # below GREEDY_EPS: treated as greedy rather than divided by


def cfg(prompt: Sequence[int] = (), **kw: object) -> SamplerRequestConfig:
    return SamplerRequestConfig(SamplingParams(**kw), list(prompt))  # type: ignore[arg-type]


def step_of(rids: Sequence[str]) -> ResourceStep:
    return ResourceStep(segments=tuple(Segment(r, "main", 1) for r in rids))


def ctx_of(rids: Sequence[str]) -> StepContext:
    return StepContext(request_ids=list(rids), graph_walk="decode", slot=0, capture=False)


def plan_of(
    res: SamplerResource, rids: Sequence[str], real: Sequence[str] | None = None
) -> SamplerPlan:
    return res.plan(step_of(rids), ctx_of(rids if real is None else real))


def run_step(
    res: SamplerResource,
    rids: Sequence[str],
    logits: torch.Tensor,
    real: Sequence[str] | None = None,
) -> SampleOutput:
    step, ctx = step_of(rids), ctx_of(rids if real is None else real)
    out = res.sample(res.plan(step, ctx), logits)
    res.commit(step, ctx)
    return out


def spaced_logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    """Random logits whose values differ by at least 0.1, so argmax is never a near tie."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=g).float() * 0.1 for _ in range(rows)])


# -- greedy, temperature, top-k ----------------------------------------------------------------


def test_greedy_rows_are_argmax_in_a_mixed_batch() -> None:
    res = SamplerResource(V, seed=1)
    rids = [f"r{i}" for i in range(6)]
    for i, rid in enumerate(rids):
        res.ingest_request(rid, cfg(temperature=0.0 if i % 2 == 0 else 1.3, top_k=5))
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3))
    plan = plan_of(res, rids)
    assert not plan.all_greedy and plan.greedy is not None
    for _ in range(20):
        toks = res.sample(plan, logits).token_ids
        for i in range(0, 6, 2):
            assert toks[i] == int(logits[i].argmax())


def test_all_greedy_fast_path_and_feature_flags() -> None:
    res = SamplerResource(V)
    res.ingest_request("a", cfg(temperature=0.0, top_k=3, top_p=0.5, seed=4))
    assert GREEDY_TINY < GREEDY_EPS
    res.ingest_request("b", cfg(temperature=GREEDY_TINY))
    plan = plan_of(res, ["a", "b"])
    assert plan.all_greedy and plan.temperature is None
    assert plan.top_k is None and plan.top_p_cut is None and plan.log_min_p is None
    assert plan.pen_rows is None and plan.seeded_rows is None and not plan.any_random
    logits = torch.randn(2, V)
    assert res.sample(plan, logits).token_ids == logits.argmax(dim=1).tolist()


def test_bf16_logits_sample_as_their_float32_widening() -> None:
    """The decoder hands bf16 models' logits over in bf16: every path answers as on float32."""
    kinds = [
        cfg(temperature=0.0),
        cfg([3, 4], temperature=0.0, repetition_penalty=1.5, logprobs=2),
        cfg(temperature=0.8, top_k=6, seed=5),
        cfg(temperature=1.1, top_p=0.7, min_p=0.05, frequency_penalty=0.3),
    ]
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(9)).bfloat16()
    for rows in ([0], [0, 1], [0, 1, 2, 3]):  # all-greedy fast path, penalties, random draws
        got: list[SampleOutput] = []
        for x in (logits, logits.float()):
            res = SamplerResource(V, seed=2)
            rids = [f"r{i}" for i in rows]
            for i, rid in zip(rows, rids, strict=True):
                res.ingest_request(rid, kinds[i])
            got.append(run_step(res, rids, x[rows]))
            got.append(run_step(res, rids, x[rows]))  # penalty counts moved by the first
        assert [o.token_ids for o in got[:2]] == [o.token_ids for o in got[2:]]
        assert [o.logprobs for o in got[:2]] == [o.logprobs for o in got[2:]]


def test_flags_follow_what_the_batch_uses() -> None:
    res = SamplerResource(V)
    res.ingest_request("plain", cfg(temperature=1.0))
    res.ingest_request("k", cfg(top_k=4))
    res.ingest_request("pen", cfg(presence_penalty=0.5))
    plain = plan_of(res, ["plain"])
    assert plain.top_k is None and plain.pen_rows is None and plain.any_random
    mixed = plan_of(res, ["plain", "k", "pen"])
    assert mixed.top_k is not None and mixed.top_k.flatten().tolist() == [0, 4, 0]
    assert mixed.top_k_max == 4 and mixed.pen_rows is not None and mixed.top_p_cut is None


def test_temperature_to_zero_limit_is_greedy() -> None:
    res = SamplerResource(V, seed=2)
    res.ingest_request("cold", cfg(temperature=1e-3))
    logits = spaced_logits(1)
    plan = plan_of(res, ["cold"])
    assert not plan.all_greedy
    draws = {res.sample(plan, logits).token_ids[0] for _ in range(200)}
    assert draws == {int(logits.argmax())}


def test_top_k_one_equals_greedy() -> None:
    res = SamplerResource(V, seed=5)
    for i in range(4):
        res.ingest_request(f"k{i}", cfg(temperature=1.5, top_k=1))
    logits = spaced_logits(4, seed=9)
    plan = plan_of(res, [f"k{i}" for i in range(4)])
    for _ in range(100):
        assert res.sample(plan, logits).token_ids == logits.argmax(dim=1).tolist()


def test_top_k_draws_only_from_the_k_best() -> None:
    res = SamplerResource(V, seed=6)
    res.ingest_request("k", cfg(temperature=2.0, top_k=3))
    res.ingest_request("all", cfg(temperature=2.0))
    logits = torch.zeros(2, V)
    logits[:, :4] = torch.tensor([3.0, 2.9, 2.8, 2.7])
    plan = plan_of(res, ["k", "all"])
    seen_k: set[int] = set()
    seen_all: set[int] = set()
    for _ in range(400):
        a, b = res.sample(plan, logits).token_ids
        seen_k.add(a)
        seen_all.add(b)
    assert seen_k == {0, 1, 2}
    assert len(seen_all) > 4  # the unfiltered neighbour row is untouched by its neighbour's k


def test_each_row_is_filtered_the_same_alone_or_batched() -> None:
    """Rows of every filter combination, batched in ways that take each kernel path (partial
    top-k, full sort) and each neighbour's parameters, come out as they do alone."""
    configs = {
        "none": cfg(temperature=0.9),
        "k": cfg(top_k=5),
        "p": cfg(top_p=0.6),
        "kp": cfg(top_k=7, top_p=0.5),
        "kp_wide": cfg(top_k=20, top_p=0.8, min_p=0.05),
        "m": cfg(temperature=1.4, min_p=0.2),
        "pen": cfg([1, 2, 3], repetition_penalty=1.3, top_k=4),
    }
    res = SamplerResource(V)
    for rid, c in configs.items():
        res.ingest_request(rid, c)
    g = torch.Generator().manual_seed(21)
    own = {rid: torch.randn(1, V, generator=g) * 2 for rid in configs}
    alone = {rid: res.process_logits(plan_of(res, [rid]), own[rid]) for rid in configs}
    for rid, kept in alone.items():
        assert 0 < int(torch.isfinite(kept).sum()) <= V, rid
    for batch in (
        ["none", "k", "kp"],  # top-p only where top-k is on: partial top-k path
        ["kp", "p", "none"],  # a top-p-only row forces the full sort
        list(configs),
        ["kp_wide", "m", "pen", "k"],
    ):
        got = res.process_logits(plan_of(res, batch), torch.cat([own[r] for r in batch]))
        for i, rid in enumerate(batch):
            assert torch.equal(got[i], alone[rid][0]), (batch, rid)


# -- penalties ---------------------------------------------------------------------------------

RAW = [2.0, 1.0, -1.0, 3.0, -2.0, 0.5]


def _penalised_resource(temperature: float) -> tuple[SamplerResource, SamplerPlan]:
    """Prompt {1, 4}; outputs 2, 2, 3 committed through real steps (greedy spikes)."""
    res = SamplerResource(6)
    res.ingest_request(
        "p",
        cfg(
            [1, 4, 4],
            temperature=temperature,
            repetition_penalty=1.5,
            presence_penalty=0.5,
            frequency_penalty=0.25,
        ),
    )
    for tok in (2, 2, 3):
        spike = torch.zeros(1, 6)
        spike[0, tok] = 100.0
        if temperature == 0.0:
            assert run_step(res, ["p"], spike).token_ids == [tok]
        else:
            res.record("p", tok)
    return res, plan_of(res, ["p"])


def test_penalties_match_hand_computed_values() -> None:
    res, plan = _penalised_resource(0.0)
    got = res.process_logits(plan, torch.tensor([RAW]))
    expected = [
        2.0,  # unseen
        1.0 / 1.5,  # prompt only, positive: divided; no presence/frequency
        -1.0 * 1.5 - 0.25 * 2 - 0.5,  # output twice, negative: multiplied, then both penalties
        3.0 / 1.5 - 0.25 * 1 - 0.5,  # output once, positive
        -2.0 * 1.5,  # prompt only, negative
        0.5,  # unseen
    ]
    torch.testing.assert_close(got[0], torch.tensor(expected))
    # Greedy answers argmax of the penalised logits: token 3 (raw best) drops below token 0.
    assert res.sample(plan, torch.tensor([RAW])).token_ids == [0]


def test_penalties_then_temperature() -> None:
    res, plan = _penalised_resource(0.5)
    greedy_res, greedy_plan = _penalised_resource(0.0)
    penalised = greedy_res.process_logits(greedy_plan, torch.tensor([RAW]))
    got = res.process_logits(plan, torch.tensor([RAW]))
    torch.testing.assert_close(got, penalised / 0.5)


def test_penalty_state_advances_only_on_commit_and_does_not_leak() -> None:
    res = SamplerResource(6, initial_capacity=2)
    res.ingest_request("p", cfg(temperature=0.0, frequency_penalty=1.0))
    spike = torch.tensor([[0.0, 0.0, 9.0, 0.0, 0.0, 0.0]])
    step, ctx = step_of(["p"]), ctx_of(["p"])
    plan = res.plan(step, ctx)
    res.sample(plan, spike)
    res.sample(plan, spike)  # sampled twice, never committed
    plan = res.plan(step, ctx)
    assert res.process_logits(plan, spike)[0, 2] == 9.0
    res.sample(plan, spike)
    res.commit(step, ctx)
    assert res.process_logits(res.plan(step, ctx), spike)[0, 2] == 8.0
    # A new request reusing the freed penalty row starts clean.
    res.remove_request("p")
    res.ingest_request("q", cfg(temperature=0.0, frequency_penalty=1.0))
    assert res.process_logits(plan_of(res, ["q"]), spike)[0, 2] == 9.0


def test_unpenalised_row_is_untouched_next_to_a_penalised_one() -> None:
    res = SamplerResource(6)
    res.ingest_request("pen", cfg([0, 1, 2], temperature=0.0, repetition_penalty=2.0))
    res.ingest_request("free", cfg(temperature=0.0))
    logits = torch.tensor([RAW, RAW])
    got = res.process_logits(plan_of(res, ["pen", "free"]), logits)
    assert torch.equal(got[1], logits[1])
    assert got[0, 0] == 1.0 and got[0, 2] == -2.0


def test_prompt_outside_vocab_is_rejected() -> None:
    res = SamplerResource(6)
    with pytest.raises(ValueError, match="vocabulary"):
        res.ingest_request("bad", cfg([7], repetition_penalty=1.2))


# -- logprobs ----------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_sorted_top_k() -> None:
    res = SamplerResource(V, seed=8)
    res.ingest_request("three", cfg([1, 2], temperature=0.7, repetition_penalty=1.8, logprobs=3))
    res.ingest_request("zero", cfg(temperature=0.0, logprobs=0))
    res.ingest_request("none", cfg())
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    out = res.sample(plan_of(res, ["three", "zero", "none"]), logits)
    assert out.logprobs is not None and out.logprobs[2] is None
    lp = logits.log_softmax(dim=1)
    three, zero = out.logprobs[0], out.logprobs[1]
    assert three is not None and zero is not None
    assert three.token_id == out.token_ids[0]
    assert three.logprob == pytest.approx(float(lp[0, out.token_ids[0]]), abs=1e-6)
    ref = lp[0].topk(3)
    assert [t for t, _ in three.top] == ref.indices.tolist()
    assert [v for _, v in three.top] == pytest.approx(ref.values.tolist(), abs=1e-6)
    assert [v for _, v in three.top] == sorted((v for _, v in three.top), reverse=True)
    assert zero.top == () and zero.logprob == pytest.approx(float(lp[1].max()), abs=1e-6)


def test_no_logprobs_asked_gives_none() -> None:
    res = SamplerResource(V)
    res.ingest_request("a", cfg())
    assert res.sample(plan_of(res, ["a"]), torch.randn(1, V)).logprobs is None


# -- lifecycle ---------------------------------------------------------------------------------


def test_ingest_is_idempotent_and_tables_grow() -> None:
    res = SamplerResource(V, initial_capacity=2)
    res.ingest_request("a", cfg(temperature=0.3))
    res.ingest_request("a", cfg(temperature=1.9))  # second ingest is a no-op
    rids = ["a"] + [f"x{i}" for i in range(9)]
    for i, rid in enumerate(rids[1:]):
        res.ingest_request(rid, cfg(temperature=0.1 * (i + 1), presence_penalty=0.1))
    plan = plan_of(res, rids)
    assert plan.temperature is not None
    expected = [0.3] + [0.1 * (i + 1) for i in range(9)]
    assert plan.temperature.flatten().tolist() == pytest.approx(expected)
    res.remove_request("a")
    res.remove_request("a")  # removing twice is harmless
    with pytest.raises(KeyError):
        res.num_output_tokens("a")


def test_padding_rows_are_sampled_but_never_recorded() -> None:
    res = SamplerResource(V)
    res.ingest_request("a", cfg(temperature=0.0))
    res.ingest_request("b", cfg(temperature=0.0))
    logits = spaced_logits(3)
    # "pad" is unknown; "b" is known but not a real row of this step (a padding copy).
    out = run_step(res, ["a", "pad", "b"], logits, real=["a"])
    assert out.token_ids[1] == int(logits[1].argmax())
    assert res.num_output_tokens("a") == 1 and res.num_output_tokens("b") == 0


def test_commit_of_another_step_is_refused() -> None:
    res = SamplerResource(V)
    for rid in ("a", "b"):
        res.ingest_request(rid, cfg())
    res.sample(plan_of(res, ["a", "b"]), torch.randn(2, V))
    with pytest.raises(RuntimeError, match="does not match"):
        res.commit(step_of(["b", "a"]), ctx_of(["b", "a"]))


def test_commit_without_sample_records_nothing() -> None:
    res = SamplerResource(V)
    res.ingest_request("a", cfg())
    plan_of(res, ["a"])
    res.commit(step_of(["a"]), ctx_of(["a"]))
    assert res.num_output_tokens("a") == 0


def test_wrong_logits_shape_is_refused() -> None:
    res = SamplerResource(V)
    res.ingest_request("a", cfg())
    with pytest.raises(ValueError, match="rows"):
        res.sample(plan_of(res, ["a"]), torch.randn(2, V))


# -- seeding -----------------------------------------------------------------------------------


def _seq_logits(steps: int, rows: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randn(rows, V, generator=g) * 0.5 for _ in range(steps)]


def _seeded_sequence(res: SamplerResource, order: list[str], target: str, steps: int) -> list[int]:
    """Run `steps` committed steps of `order`; `target` always sees the same logits row."""
    own = _seq_logits(steps, 1)
    noise = _seq_logits(steps, len(order))
    toks = []
    for s in range(steps):
        logits = noise[s].clone()
        i = order.index(target)
        logits[i] = own[s][0]
        toks.append(run_step(res, order, logits).token_ids[i])
    return toks


def _seeded_params(seed: int) -> SamplerRequestConfig:
    return cfg([3, 4], temperature=1.0, top_p=0.95, top_k=20, seed=seed, frequency_penalty=0.3)


def test_same_seed_same_tokens_across_resources() -> None:
    a, b = SamplerResource(V, seed=1), SamplerResource(V, seed=999)
    a.ingest_request("s", _seeded_params(1234))
    b.ingest_request("s", _seeded_params(1234))
    seq_a = _seeded_sequence(a, ["s"], "s", 12)
    assert seq_a == _seeded_sequence(b, ["s"], "s", 12)
    assert len(set(seq_a)) > 3  # it really sampled


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    alone = SamplerResource(V, seed=0)
    alone.ingest_request("s", _seeded_params(77))
    reference = _seeded_sequence(alone, ["s"], "s", 12)
    for order, engine_seed in (
        (["s", "u1", "g", "t2"], 5),
        (["u1", "t2", "g", "s"], 6),
        (["g", "s", "u1"], 7),
    ):
        res = SamplerResource(V, seed=engine_seed)
        res.ingest_request("u1", cfg(temperature=0.9, presence_penalty=1.0))  # unseeded
        res.ingest_request("g", cfg(temperature=0.0, logprobs=2))  # greedy
        res.ingest_request("t2", cfg(temperature=1.2, min_p=0.1, seed=5))  # another seed
        res.ingest_request("s", _seeded_params(77))
        assert _seeded_sequence(res, order, "s", 12) == reference, order


def test_different_seeds_differ_and_uncommitted_draws_repeat() -> None:
    res = SamplerResource(V)
    res.ingest_request("a", cfg(seed=1))
    res.ingest_request("b", cfg(seed=2))
    seq_a = _seeded_sequence(res, ["a", "b"], "a", 12)
    res2 = SamplerResource(V)
    res2.ingest_request("a", cfg(seed=1))
    res2.ingest_request("b", cfg(seed=2))
    seq_b = _seeded_sequence(res2, ["a", "b"], "b", 12)
    assert seq_a != seq_b
    # Without a commit the output index does not move, so the same draw comes back.
    res3 = SamplerResource(V)
    res3.ingest_request("a", cfg(seed=1))
    logits = torch.zeros(1, V)
    plan = plan_of(res3, ["a"])
    first = res3.sample(plan, logits).token_ids
    assert all(res3.sample(plan_of(res3, ["a"]), logits).token_ids == first for _ in range(5))
    res3.commit(step_of(["a"]), ctx_of(["a"]))
    nxt = [run_step(res3, ["a"], logits).token_ids[0] for _ in range(8)]
    assert len(set(nxt)) > 1


def test_unseeded_rows_follow_the_engine_seed() -> None:
    def draws(engine_seed: int) -> list[int]:
        res = SamplerResource(V, seed=engine_seed)
        res.ingest_request("u", cfg())
        return [run_step(res, ["u"], torch.zeros(1, V)).token_ids[0] for _ in range(10)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)
