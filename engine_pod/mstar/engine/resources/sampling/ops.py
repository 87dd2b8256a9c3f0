"""Batched sampling kernels in plain torch: penalties, filters, noise, logprobs.

Every function works on whole `[rows, vocab]` tensors with per-row parameters as `[rows, 1]`
columns, so a batch costs a fixed number of kernel launches however many rows it has. A row
whose parameter is the identity (penalty 1.0, top-k off, min-p 0...) comes out bit-for-bit
unchanged, which is what makes a request's tokens independent of who it is batched with.
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")
_M32 = 0xFFFFFFFF
# lowbias32 (C. Wellons' hash prospector): both multipliers are below 2**31, so a 32-bit value
# times either stays below 2**63 and int64 tensors never overflow, on any device.
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97
_GOLDEN = 0x9E3779B9
#: Slack on top-p's cumulative-probability test, so float32 rounding at an exact boundary
#: (p equal to a partial sum) does not admit one extra token.
TOP_P_EPS = 1e-6


def mix32(x: int) -> int:
    """The scalar twin of `mix32_`: a bijective 32-bit integer hash."""
    x &= _M32
    x ^= x >> 16
    x = (x * _MUL1) & _M32
    x ^= x >> 15
    x = (x * _MUL2) & _M32
    x ^= x >> 15
    return x


def mix32_(x: torch.Tensor) -> torch.Tensor:
    """`mix32` in place over an int64 tensor holding values in [0, 2**32)."""
    x.bitwise_xor_(x >> 16)
    x.mul_(_MUL1).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MUL2).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    return x


def seed_base(seed: int) -> int:
    """Fold an arbitrary Python int seed (negative or wider than 64 bits) into a 32-bit key."""
    s = seed & ((1 << 64) - 1)
    return mix32(mix32((s & _M32) ^ _GOLDEN) ^ (s >> 32))


def row_key(base: int, counter: int) -> int:
    """The key of one request's `counter`-th sampled token: all its per-vocab noise derives
    from this, so it depends on the seed and the output index and nothing else."""
    return mix32(base ^ mix32((counter + _GOLDEN) & _M32))


def vocab_hash(vocab_size: int, device: torch.device) -> torch.Tensor:
    """Per-vocab-id hashes, computed once per resource and xor-ed with each row key."""
    v = torch.arange(vocab_size, dtype=torch.int64, device=device)
    v.add_(_GOLDEN).bitwise_and_(_M32)
    return mix32_(v)


def seeded_gumbel(keys: torch.Tensor, vhash: torch.Tensor) -> torch.Tensor:
    """Gumbel noise `[len(keys), vocab]` from a counter-based hash of (row key, vocab id).

    23 bits make the uniform: u = (h + 0.5) / 2**23 is exactly representable in float32 and
    strictly inside (0, 1), so the double log is always finite. The truncated Gumbel tails
    (outside about [-2.8, 16.6]) carry a probability below 1e-7.
    """
    h = keys.unsqueeze(1).bitwise_xor(vhash.unsqueeze(0))
    mix32_(h)
    u = (h >> 9).to(torch.float32).add_(0.5).mul_(2.0**-23)
    return u.log_().neg_().log_().neg_()


#: Largest float32 below 1: CUDA's uniform_ draws from (0, 1], and u == 1 would make +inf noise.
_BELOW_ONE = 1.0 - 2.0**-24


def random_gumbel_(out: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill `out` with Gumbel noise ``-log(-log u)`` from `generator`'s uniforms.

    Uniforms, not ``exponential_``: on CPU that is ~6x slower (32 x 49152 rows: 34.6 ms against
    5.5 ms, most of a decode step at batch 32). u == 0 gives -inf noise (that token cannot win);
    u is kept below 1 so the noise is never +inf, which on a -inf logit would make NaN.
    """
    out.uniform_(generator=generator).clamp_(max=_BELOW_ONE)
    return out.log_().neg_().log_().neg_()


def apply_penalties_(
    x: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Penalise `x` in place, with vLLM's (and HF's) definitions.

    Repetition (over prompt and output tokens): a positive logit is divided by the penalty, a
    negative one multiplied. Frequency subtracts `penalty * count`, presence subtracts `penalty`
    once, both over output tokens only. `counts` is float32 output counts per vocab id.
    """
    occurred = counts > 0
    scale = torch.where(occurred | prompt_mask, repetition, 1.0)
    x.copy_(torch.where(x > 0, x / scale, x * scale))
    x.sub_(counts * frequency)
    x.sub_(occurred * presence)
    return x


def apply_top_k_top_p_(
    x: torch.Tensor,
    top_k: torch.Tensor | None,
    top_k_max: int,
    top_p_cut: torch.Tensor | None,
    top_p_in_top_k: bool = False,
) -> torch.Tensor:
    """Mask to -inf every logit outside each row's top-k and then top-p (nucleus) set.

    `top_k` is `[rows, 1]` int64 with 0 meaning off; `top_k_max` the largest enabled k (the
    host knows it, so there is no device sync to find it). `top_p_cut` is `[rows, 1]` holding
    `p - TOP_P_EPS`, or 2.0 for an off row. Top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches p: token i stays while the mass before it is below p. Ties
    at a threshold are all kept, as a threshold-by-value mask must. `top_p_in_top_k` says every
    row with top-p on also has a k, which lets the top-p pass work on the top `kmax` only.
    """
    vocab = x.shape[1]
    if top_k is not None and (top_p_cut is None or top_p_in_top_k):
        # Every filtered row has a k: the top `kmax` values hold all that can survive, so a
        # partial top-k replaces the full-vocabulary sort.
        kmax = min(top_k_max, vocab)
        vals = x.topk(kmax, dim=1).values
        idx = top_k.clamp(1, kmax).sub_(1)
        thr = torch.where(top_k > 0, vals.gather(1, idx), NEG_INF)
    else:
        vals = x.sort(dim=1, descending=True).values
        thr = None
        if top_k is not None:
            k = torch.where(top_k > 0, top_k, vocab).clamp_(max=vocab).sub_(1)
            thr = vals.gather(1, k)
    if top_p_cut is not None:
        if thr is not None:
            vals.masked_fill_(vals < thr, NEG_INF)
        probs = vals.softmax(dim=1)
        before = probs.cumsum(dim=1).sub_(probs)
        count = (before < top_p_cut).sum(dim=1, keepdim=True).clamp_(min=1)
        # A row with top-p off keeps everything (its cut of 2.0 would pick the last kept value).
        thr_p = torch.where(top_p_cut < 1.0, vals.gather(1, count.sub_(1)), NEG_INF)
        thr = thr_p if thr is None else torch.maximum(thr, thr_p)
    assert thr is not None
    return x.masked_fill_(x < thr, NEG_INF)


def apply_min_p_(x: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with prob < min_p * max_prob, in logit space: logit < max + log(min_p).

    `log_min_p` is `[rows, 1]`, -inf for an off row (nothing is below max - inf).
    """
    thr = x.amax(dim=1, keepdim=True).add_(log_min_p)
    return x.masked_fill_(x < thr, NEG_INF)


def log_min_p(min_p: float) -> float:
    return math.log(min_p) if min_p > 0.0 else NEG_INF


def logprobs_of(
    logits: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Raw logprobs (log-softmax of the model's logits) of `chosen`, plus the top `k` sorted."""
    lp = logits.to(torch.float32).log_softmax(dim=1)
    chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    if k <= 0:
        return chosen_lp, None, None
    top = lp.topk(min(k, lp.shape[1]), dim=1)
    return chosen_lp, top.values, top.indices


def bias_index(
    parts: list[tuple[int, tuple[torch.Tensor, torch.Tensor]]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The step's logit biases as flat (rows, token ids, values) for one `index_put_`."""
    if not parts:
        return None
    rows = torch.cat([torch.full_like(ids, i) for i, (ids, _) in parts])
    ids = torch.cat([ids for _, (ids, _) in parts])
    values = torch.cat([values for _, (_, values) in parts])
    return rows.to(device), ids, values
