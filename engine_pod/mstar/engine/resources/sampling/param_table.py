"""The sampler's per-request parameter table: one row per request, and the plan gather.

A request's parameters are written once at ingest as one float32 row (`request_row`); a step's
`gather_plan` is then one index gather of those rows plus feature bits OR-ed over the batch, so
a stage (top-k, min-p, penalties) runs only when some row uses it. Off values are each stage's
identity, so padding rows (slot 0) and rows that do not use a stage pass through unchanged.
"""

from __future__ import annotations

import torch

from mstar.engine.resources.host_copy import to_device
from mstar.engine.resources.sampling import ops
from mstar.engine.resources.sampling.values import RequestState, SamplerPlan
from mstar.engine.sampling_params import SamplingParams

#: Temperatures below this are greedy (dividing by them would only overflow).
GREEDY_EPS = 1e-5

# Columns of the per-request parameter table. Off values are the identity for their stage.
TEMP, TOP_P_CUT, LOG_MIN_P, REP, PRES, FREQ, TOP_K, GREEDY = range(8)
NCOLS = 8
IDENTITY_ROW = (1.0, 2.0, ops.NEG_INF, 1.0, 0.0, 0.0, 0.0, 1.0)

# Feature bits, OR-ed over a batch's rows at plan time.
F_GREEDY, F_TOPK, F_TOPP, F_MINP, F_PENALTY, F_SEEDED = (1 << i for i in range(6))


def request_row(p: SamplingParams, vocab_size: int) -> tuple[int, int, tuple[float, ...]]:
    """(feature bits without the penalty bit, effective top-k, the table row) of ``p``."""
    greedy = p.temperature < GREEDY_EPS
    top_k = p.top_k if 0 < p.top_k < vocab_size else 0
    features = F_GREEDY if greedy else 0
    if not greedy:
        features |= (
            (F_TOPK if top_k else 0)
            | (F_TOPP if p.top_p < 1.0 else 0)
            | (F_MINP if p.min_p > 0.0 else 0)
            | (F_SEEDED if p.seed is not None else 0)
        )
    row = (
        1.0 if greedy else p.temperature,
        p.top_p - ops.TOP_P_EPS if p.top_p < 1.0 else 2.0,
        ops.log_min_p(p.min_p),
        p.repetition_penalty,
        p.presence_penalty,
        p.frequency_penalty,
        float(top_k),
        1.0 if greedy else 0.0,
    )
    return features, top_k, row


def gather_plan(
    reqs: dict[str, RequestState],
    params: torch.Tensor,
    rids: tuple[str, ...],
    real: set[str],
    device: torch.device,
) -> SamplerPlan:
    """The static part of a step's plan: rows follow ``rids``; ``real`` are the rows that
    commit (the others are padding or rows whose token is not an output)."""
    slots: list[int] = []
    pen_rows: list[int] = []
    commit_rows: list[int] = []
    seeded_rows: list[int] = []
    logprob_rows: list[tuple[int, int]] = []
    grammar_rows: list[int] = []
    min_token_rows: list[int] = []
    bias_parts: list[tuple[int, tuple[torch.Tensor, torch.Tensor]]] = []
    any_bits = 0
    n_greedy = 0
    top_k_max = 0
    any_random = False
    top_p_alone = False
    for i, rid in enumerate(rids):
        req = reqs.get(rid)
        if req is None:  # a padding row: greedy over identity parameters, never recorded
            slots.append(0)
            pen_rows.append(0)
            n_greedy += 1
            continue
        if rid in real:
            commit_rows.append(i)
            if req.matcher is not None:
                grammar_rows.append(i)
            if req.min_suppress is not None:
                min_token_rows.append(i)
        if req.bias is not None:
            bias_parts.append((i, req.bias))
        bits = req.features
        any_bits |= bits
        if bits & (F_TOPP | F_TOPK) == F_TOPP:
            top_p_alone = True
        slots.append(req.slot)
        pen_rows.append(req.pen_row)
        if bits & F_GREEDY:
            n_greedy += 1
        elif req.seed_base is not None:
            seeded_rows.append(i)
        else:
            any_random = True
        if req.top_k > top_k_max:
            top_k_max = req.top_k
        if req.logprobs is not None:
            logprob_rows.append((i, req.logprobs))
    n = len(rids)
    all_greedy = n_greedy == n
    dev = device
    cols = params.index_select(0, to_device(slots, torch.int64, dev))
    use_pen = bool(any_bits & F_PENALTY)

    def col(c: int, live: bool) -> torch.Tensor | None:
        return cols[:, c : c + 1] if live else None

    return SamplerPlan(
        request_ids=rids,
        commit_rows=tuple(commit_rows),
        all_greedy=all_greedy,
        greedy=None if all_greedy or n_greedy == 0 else cols[:, GREEDY] > 0,
        temperature=col(TEMP, not all_greedy),
        top_k=cols[:, TOP_K : TOP_K + 1].long() if any_bits & F_TOPK else None,
        top_k_max=top_k_max,
        top_p_cut=col(TOP_P_CUT, bool(any_bits & F_TOPP)),
        top_p_in_top_k=not top_p_alone,
        log_min_p=col(LOG_MIN_P, bool(any_bits & F_MINP)),
        pen_rows=to_device(pen_rows, torch.int64, dev) if use_pen else None,
        repetition=col(REP, use_pen),
        presence=col(PRES, use_pen),
        frequency=col(FREQ, use_pen),
        seeded_rows=to_device(seeded_rows, torch.int64, dev) if seeded_rows else None,
        seeded_keys=None,
        seeded_index=tuple(seeded_rows),
        any_random=any_random,
        logprob_rows=tuple(logprob_rows),
        grammar_rows=tuple(grammar_rows),
        bias_index=ops.bias_index(bias_parts, dev),
        min_token_rows=tuple(min_token_rows),
    )
