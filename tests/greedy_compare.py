"""Driving an engine for greedy tokens with log-probabilities, and comparing two such runs.

Two engines that round differently (FlashInfer's bf16 attention and the torch backend's, or one
schedule against another in bf16) cannot promise identical greedy tokens: where the top two
candidates are nearly tied, a rounding difference may pick the other one, and from there the
continuations are different texts. `assert_close_until_near_tie` therefore asks for identical
tokens, and chosen-token log-probabilities within ``logprob_tol``, up to the first token where
the runs differ; that token is allowed only if the reference's top-2 gap there is below
``near_tie`` (a flip needs both logprobs to move, so the bound is twice the tolerance). A
confident divergence, or a logprob drift beyond the tolerance, fails with its position.

Calibration, measured on CPU on the GPU tests' tiny Llama (head_dim 64, init 0.2, bf16): two
attention implementations that differ only in their final rounding drifted by at most 0.072
nats and diverged once, at a top-2 gap of 0.031 (8 prompts x 24 tokens). ``LOGPROB_TOL`` is that
drift with a ~3x margin. bf16 against fp32 weights drifts 0.46: no tolerance here covers that.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar.engine.engine import LLMEngine
from mstar.engine.outputs import TokenLogprob
from mstar.engine.sampling_params import SamplingParams

LOGPROB_TOL = 0.2
NEAR_TIE = 2 * LOGPROB_TOL
#: a router near-tie: the reference's k-th and (k+1)-th router logits closer than this many
#: bf16 rounding steps (relative 2^-7) of the k-th's magnitude. Calibration: the Qwen3-MoE
#: test model's one bf16 divergence routes differently first at a margin of 0.047, 3 steps at
#: its logit (in [2, 4)); the logits are bf16 dot products of inputs the two engines rounded
#: differently through every earlier layer, so a few steps of drift are rounding
ROUTER_TIE_ULPS = 4

Tokens = list[list[int]]
Logprobs = list[list[TokenLogprob]]


def drive(
    engine: LLMEngine, prompts: Sequence[Sequence[int]], params: SamplingParams, tag: str = "p"
) -> tuple[Tokens, Logprobs]:
    """Run ``prompts`` concurrently to completion: tokens and logprobs per prompt, in order."""
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    toks: dict[str, list[int]] = {r: [] for r in ids}
    lps: dict[str, list[TokenLogprob]] = {r: [] for r in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            toks[out.request_id].extend(out.new_token_ids)
            lps[out.request_id].extend(out.new_logprobs or [])
    return [toks[r] for r in ids], [lps[r] for r in ids]


def top2_gap(lp: TokenLogprob) -> float:
    """Logprob margin of the most likely token over the second (needs ``logprobs >= 2``)."""
    if len(lp.top) < 2:
        raise ValueError("a near-tie check needs the top 2 logprobs (SamplingParams.logprobs=2)")
    return lp.top[0][1] - lp.top[1][1]


def assert_close_until_near_tie(
    ref: tuple[Tokens, Logprobs],
    got: tuple[Tokens, Logprobs],
    *,
    logprob_tol: float = LOGPROB_TOL,
    near_tie: float = NEAR_TIE,
) -> tuple[int, float]:
    """(tokens compared, largest logprob drift); raises AssertionError on a real difference."""
    compared, worst = 0, 0.0
    for i, (rt, rl, gt, gl) in enumerate(zip(*ref, *got, strict=True)):
        if len(rt) != len(gt) or len(rl) != len(rt) or len(gl) != len(gt):
            raise AssertionError(f"prompt {i}: {len(rt)} vs {len(gt)} tokens (or logprobs)")
        for t, (a, b) in enumerate(zip(rt, gt, strict=True)):
            if a != b:
                gap = top2_gap(rl[t])
                if gap >= near_tie:
                    raise AssertionError(
                        f"prompt {i} diverges at token {t} ({a} vs {b}) where the reference's "
                        f"top-2 gap is {gap:.4f} >= {near_tie}: not a rounding near-tie"
                    )
                break
            drift = abs(rl[t].logprob - gl[t].logprob)
            if drift > logprob_tol:
                raise AssertionError(
                    f"prompt {i} token {t}: logprob {gl[t].logprob:.4f} vs reference "
                    f"{rl[t].logprob:.4f}, drift {drift:.4f} > {logprob_tol}"
                )
            worst = max(worst, drift)
            compared += 1
    return compared, worst


def router_logits(engine: LLMEngine, tokens: Sequence[int]) -> list[torch.Tensor]:
    """Every MoE router's logits, in the order they run, for ``tokens`` as one prompt (its
    prefill, the first sampled token's step): float32 [rows, experts] per router call."""
    calls: list[torch.Tensor] = []
    hooks = [
        block.router_run.register_forward_hook(lambda m, i, out: calls.append(out.float()))
        for block in engine.decoder.moe_blocks()
    ]
    try:
        engine.generate([list(tokens)], SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def router_flip(
    ref: LLMEngine, got: LLMEngine, tokens: Sequence[int], k: int
) -> tuple[float, float]:
    """Where the two engines' routers first choose different top-``k`` experts for ``tokens``:
    (the reference's margin there between its k-th and (k+1)-th logit, the near-tie bound
    for it); AssertionError when they choose the same experts everywhere."""
    for a, b in zip(router_logits(ref, tokens), router_logits(got, tokens), strict=True):
        top_a, top_b = (
            a.topk(k, dim=-1).indices.sort(-1).values,
            b.topk(k, dim=-1).indices.sort(-1).values,
        )
        differs = (top_a != top_b).any(-1).nonzero()
        if differs.numel():
            row = a[int(differs[0])].sort(descending=True).values
            bound = ROUTER_TIE_ULPS * torch.finfo(torch.bfloat16).eps * float(row[k - 1].abs())
            return float(row[k - 1] - row[k]), bound
    raise AssertionError("the routers choose the same experts at every step: no router flip")
