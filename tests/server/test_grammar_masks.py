"""Grammar masks with the real xgrammar over a byte-level vocabulary (256 bytes + EOS): what
`MaskWorker` allows, in both its modes, how `apply_masks` writes them, and that the sampler
advances a matcher at commit only (an aborted step, or a recompute, moves nothing)."""

from __future__ import annotations

import functools

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel

from mstar.engine.resources.sampling import SamplerRequestConfig, SamplerResource
from mstar.engine.resources.sampling.grammar import GrammarBackend, MaskWorker, apply_masks
from mstar.engine.resources.step import ResourceStep, Segment, StepContext
from mstar.engine.sampling_params import GrammarSpec, SamplingParams

EOS = 256
ENUM = GrammarSpec.json_schema({"enum": ["ab", "cd"]})


@functools.cache
def _tokenizer() -> Tokenizer:
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<eos>"] = EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return tok


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend(_tokenizer().to_str(), EOS + 1, [EOS])


def _id(ch: str) -> int:
    """The token of one character (its byte, in this vocabulary)."""
    return int(_tokenizer().encode(ch).ids[0])


@pytest.mark.parametrize("overlap", [True, False], ids=["worker thread", "inline"])
def test_masks_follow_the_grammar(backend: GrammarBackend, overlap: bool) -> None:
    worker = MaskWorker(backend, overlap)
    matcher = backend.matcher(ENUM)

    def allowed() -> set[int]:
        result = worker.submit([(0, matcher)]).result()
        assert result.forbidden is not None and not result.ended
        return {i for i in range(EOS + 1) if not result.forbidden[0, i]}

    assert allowed() == {_id('"')}
    assert matcher.accept_token(_id('"'))
    assert allowed() == {_id("a"), _id("c")}
    for ch in 'ab"':
        assert matcher.accept_token(_id(ch))
    assert allowed() == {EOS}
    assert matcher.accept_token(EOS)
    assert worker.submit([(1, matcher), (4, None)]).result().ended == {
        1: "stop",
        4: "grammar_dead_end",
    }
    worker.close()


def test_apply_masks_touches_only_grammar_rows(backend: GrammarBackend) -> None:
    worker = MaskWorker(backend, overlap=False)
    result = worker.submit([(1, backend.matcher(ENUM))]).result()
    logits = torch.zeros(2, EOS + 1)
    apply_masks(logits, result)
    assert torch.equal(logits[0], torch.zeros(EOS + 1))
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [_id('"')]


def test_the_sampler_advances_a_matcher_at_commit_only(backend: GrammarBackend) -> None:
    sampler = SamplerResource(EOS + 1, grammar=backend, eos_token_ids=[EOS])
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, grammar=ENUM)
    sampler.ingest_request("r", SamplerRequestConfig(params))
    step = ResourceStep((Segment("r", "main", 1),))
    ctx = StepContext(["r"], "llm", 0, False)
    drawn = []
    for _ in range(2):  # a step that is sampled but never committed (aborted, recomputed)
        out = sampler.sample(sampler.plan(step, ctx), torch.zeros(1, EOS + 1))
        drawn.append(out.token_ids[0])
    assert drawn == [_id('"')] * 2
    sampler.commit(step, ctx)
    out = sampler.sample(sampler.plan(step, ctx), torch.zeros(1, EOS + 1))
    assert out.token_ids[0] in {_id("a"), _id("c")}  # the matcher moved once
