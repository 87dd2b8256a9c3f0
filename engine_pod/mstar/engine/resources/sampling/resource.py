"""`SamplerResource`: per-request sampling state and the batched `sample` of one step.

Per-request parameters live in one device table (a row per request, written once at ingest), so
`plan` is one index gather however many features are in play; vocab-wide penalty state (output
counts, prompt mask) is held only for requests that use a penalty. `sample` draws but records
nothing: `commit` applies the drawn tokens, so a step that is planned and sampled but never
committed leaves every request exactly where it was (same seeded draw next time).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from mstar.engine.outputs import TokenLogprob
from mstar.engine.resources.base import Resource
from mstar.engine.resources.host_copy import to_device
from mstar.engine.resources.sampling import ops
from mstar.engine.resources.sampling.grammar import (
    GrammarBackend,
    MaskWorker,
    apply_masks,
    spare_core,
)
from mstar.engine.resources.sampling.param_table import (
    F_PENALTY,
    IDENTITY_ROW,
    NCOLS,
    gather_plan,
    request_row,
)
from mstar.engine.resources.sampling.values import (
    RequestState,
    SampleOutput,
    SamplerPlan,
    SamplerRequestConfig,
)
from mstar.engine.resources.step import ResourceStep, StepContext
from mstar.engine.sampling_params import SamplingParams
from mstar.kernels import cpu_kernels

#: (stage key, the request objects gathered, the gathered plan)
_Stage = tuple[tuple[object, ...], tuple[tuple[str, RequestState], ...], SamplerPlan]


class SamplerResource(Resource):
    """Sampling parameters and state per request; runner key "sampler", no dependencies."""

    #: Pre-plans the row gather of the next step; `plan` promotes it when the step matches.
    supports_preplan = True

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str = "cpu",
        seed: int = 0,
        initial_capacity: int = 64,
        *,
        grammar: GrammarBackend | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        """``grammar``: compiles requests' grammars (None: a grammar is refused at ingest);
        ``eos_token_ids``: what `min_tokens` holds back besides a request's stop ids."""
        self.vocab_size = vocab_size
        self.grammar = grammar
        self._eos = tuple(eos_token_ids)
        #: Time `sample` spent waiting for and applying grammar masks, and in how many steps.
        self.grammar_wait_seconds = 0.0
        self.grammar_steps = 0
        self.device = torch.device(device)
        self._masks = None if grammar is None else MaskWorker(grammar, spare_core(self.device))
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._reqs: dict[str, RequestState] = {}
        # Row 0 of each table is reserved: identity parameters (padding rows) / zero state.
        cap = max(2, initial_capacity)
        self._params = torch.empty((cap, NCOLS), dtype=torch.float32, device=self.device)
        self._params[:] = to_device(IDENTITY_ROW, torch.float32, self.device)
        self._free_slots = list(range(cap - 1, 0, -1))
        self._counts = torch.zeros((0, vocab_size), dtype=torch.float32, device=self.device)
        self._prompt_mask = torch.zeros((0, vocab_size), dtype=torch.bool, device=self.device)
        self._free_pen_rows: list[int] = []
        self._vhash: torch.Tensor | None = None
        self._work = torch.empty((0, vocab_size), dtype=torch.float32, device=self.device)
        self._noise = torch.empty((0, vocab_size), dtype=torch.float32, device=self.device)
        self._pending: tuple[SamplerPlan, torch.Tensor, list[int], dict[int, str]] | None = None
        self._staged: _Stage | None = None
        #: Steps whose plan was a promoted pre-plan (tests and the GPU report read it).
        self.promotions = 0
        #: `cpu_kernels` on CPU: the row-wise argmax (13x torch's at 32 x 49152) and the
        #: inverse-CDF draw for unseeded random rows; None elsewhere
        self._kernels = cpu_kernels.load() if self.device.type == "cpu" else None

    # -- per request ---------------------------------------------------------------------------
    def ingest_request(self, request_id: str, overrides: object | None = None) -> None:
        if request_id in self._reqs:
            return
        if overrides is None:
            cfg = SamplerRequestConfig(SamplingParams())
        elif isinstance(overrides, SamplerRequestConfig):
            cfg = overrides
        else:
            raise TypeError(f"sampler overrides must be SamplerRequestConfig, got {overrides!r}")
        p = cfg.params
        features, top_k, row = request_row(p, self.vocab_size)
        pen_row = 0
        if p.has_penalties:
            features |= F_PENALTY
            pen_row = self._open_pen_row(cfg.prompt_token_ids)
        slot = self._take_slot()
        self._params[slot] = to_device(row, torch.float32, self.device)
        state = RequestState(
            params=p,
            slot=slot,
            pen_row=pen_row,
            features=features,
            top_k=top_k,
            logprobs=p.logprobs,
            seed_base=None if p.seed is None else ops.seed_base(p.seed),
        )
        self._constraints(state)
        self._reqs[request_id] = state

    def _constraints(self, req: RequestState) -> None:
        """The grammar matcher, logit bias and `min_tokens` hold-back of a new request."""
        p, dev = req.params, self.device
        if p.grammar is not None:
            if self.grammar is None:
                raise ValueError("this sampler has no grammar backend")
            req.matcher = self.grammar.matcher(p.grammar)
        if p.logit_bias:
            ids = to_device(list(p.logit_bias), torch.int64, dev)
            values = to_device(list(p.logit_bias.values()), torch.float32, dev)
            req.bias = (ids, values)
        if p.min_tokens and p.grammar is None:
            stops = {*p.stop_token_ids, *(() if p.ignore_eos else self._eos)}
            held = sorted(t for t in stops if t < self.vocab_size)
            if held:
                req.min_suppress = to_device(held, torch.int64, dev)

    def remove_request(self, request_id: str) -> None:
        req = self._reqs.pop(request_id, None)
        if req is None:
            return
        self._params[req.slot] = to_device(IDENTITY_ROW, torch.float32, self.device)
        self._free_slots.append(req.slot)
        if req.pen_row:
            self._free_pen_rows.append(req.pen_row)

    def num_output_tokens(self, request_id: str) -> int:
        """Tokens committed so far (the seeded-noise counter)."""
        return self._reqs[request_id].num_output

    def record(self, request_id: str, token_id: int) -> None:
        """Record one output token outside a step (e.g. replaying outputs after a recompute)."""
        req = self._reqs[request_id]
        req.num_output += 1
        if req.pen_row:
            self._counts[req.pen_row, token_id] += 1.0

    def _take_slot(self) -> int:
        if not self._free_slots:
            old = self._params.shape[0]
            grown = torch.empty((2 * old, NCOLS), dtype=torch.float32, device=self.device)
            grown[:old] = self._params
            grown[old:] = to_device(IDENTITY_ROW, torch.float32, self.device)
            self._params = grown
            self._free_slots = list(range(2 * old - 1, old - 1, -1))
        return self._free_slots.pop()

    def _open_pen_row(self, prompt: Sequence[int]) -> int:
        if prompt and (min(prompt) < 0 or max(prompt) >= self.vocab_size):
            raise ValueError(f"prompt token id outside the vocabulary [0, {self.vocab_size})")
        if not self._free_pen_rows:
            old = self._counts.shape[0]
            new = max(4, 2 * old)
            counts = torch.zeros((new, self.vocab_size), dtype=torch.float32, device=self.device)
            mask = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
            counts[:old] = self._counts
            mask[:old] = self._prompt_mask
            self._counts, self._prompt_mask = counts, mask
            self._free_pen_rows = list(range(new - 1, max(old, 1) - 1, -1))
        row = self._free_pen_rows.pop()
        self._counts[row].zero_()
        self._prompt_mask[row].zero_()
        if prompt:
            ids = to_device(prompt, torch.int64, self.device)
            self._prompt_mask[row].index_fill_(0, ids, True)
        return row

    # -- per step ------------------------------------------------------------------------------
    def plan(self, step: ResourceStep, ctx: StepContext) -> SamplerPlan:
        """Gather each row's parameters once; rows follow `step.segments` (one row each).

        A pre-plan staged for exactly these rows and slot is promoted: only the dynamic part
        (the seeded rows' noise keys, which advance at every commit) is computed here.
        """
        self._pending = None
        staged, self._staged = self._staged, None
        if (
            staged is not None
            and staged[0] == self._stage_key(step, ctx)
            and all(self._reqs.get(req_id) is req for req_id, req in staged[1])
        ):
            plan = staged[2]
            self.promotions += 1
        else:
            plan = self._gather(step, ctx)
        if plan.seeded_rows is not None:
            keys = []
            for i in plan.seeded_index:
                req = self._reqs[plan.request_ids[i]]
                assert req.seed_base is not None
                keys.append(ops.row_key(req.seed_base, req.num_output))
            plan.seeded_keys = to_device(keys, torch.int64, self.device)
        self._plan_constraints(plan)
        return plan

    def _plan_constraints(self, plan: SamplerPlan) -> None:
        """The per-step part of grammars and `min_tokens`: start the masks (they fill while
        the forward runs; `sample` waits for them) and list the tokens still held back."""
        plan.masks = None
        if plan.grammar_rows:
            assert self._masks is not None
            rows = []
            for i in plan.grammar_rows:
                req = self._reqs[plan.request_ids[i]]
                rows.append((i, None if req.grammar_broken else req.matcher))
            plan.masks = self._masks.submit(rows)
        plan.suppress = None
        held_rows: list[torch.Tensor] = []
        held_ids: list[torch.Tensor] = []
        for i in plan.min_token_rows:
            req = self._reqs[plan.request_ids[i]]
            if req.num_output < req.params.min_tokens and req.min_suppress is not None:
                held_ids.append(req.min_suppress)
                held_rows.append(torch.full_like(req.min_suppress, i))
        if held_ids:
            plan.suppress = (torch.cat(held_rows), torch.cat(held_ids))

    # -- pre-planning (the static row gather, one step ahead) ----------------------------------
    def pre_plan(self, step: ResourceStep, ctx: StepContext) -> SamplerPlan:
        """Stage the next step's gather (parameters never change while a request lives)."""
        plan = self._gather(step, ctx)
        held = tuple((rid, self._reqs[rid]) for rid in plan.request_ids if rid in self._reqs)
        self._staged = (self._stage_key(step, ctx), held, plan)
        return plan

    def clear_preplan(self) -> None:
        self._staged = None

    @staticmethod
    def _stage_key(step: ResourceStep, ctx: StepContext) -> tuple[object, ...]:
        lease = ctx.slot_lease
        return (
            tuple(seg.request_id for seg in step.segments or ()),
            tuple(ctx.request_ids),
            None if lease is None else lease.slot,
        )

    def _gather(self, step: ResourceStep, ctx: StepContext) -> SamplerPlan:
        rids = tuple(seg.request_id for seg in step.segments or ())
        return gather_plan(self._reqs, self._params, rids, set(ctx.request_ids), self.device)

    def process_logits(self, plan: SamplerPlan, logits: torch.Tensor) -> torch.Tensor:
        """The logits sampling draws from (penalties, temperature, filters applied); a copy."""
        return self._process(plan, logits)[0].to(torch.float32, copy=True)

    def sample(self, plan: SamplerPlan, logits: torch.Tensor, defer: bool = False) -> SampleOutput:
        """Draw one token per row of `logits` `[rows, vocab]`; state moves only at commit.

        Logit bias, `min_tokens` and grammar masks are written into `logits` in place first
        (logprobs are then those of the constrained distribution, as in vLLM). ``defer``:
        leave the tokens on the device (`SampleOutput.deferred`) unless logprobs or a grammar
        need them on the host now; commit reads only the tensor then."""
        ended = self._constrain(plan, logits)
        x, greedy_tok = self._process(plan, logits)
        if plan.all_greedy:
            assert greedy_tok is not None
            tokens = greedy_tok
        else:
            tokens = self._draw(plan, x)
            if greedy_tok is not None:
                assert plan.greedy is not None
                tokens = torch.where(plan.greedy, greedy_tok, tokens)
        deferred = defer and not plan.logprob_rows and plan.masks is None
        token_list: list[int] = [] if deferred else tokens.tolist()
        self._pending = (plan, tokens, token_list, ended)
        logprobs = None if deferred else self._logprobs(plan, logits, tokens, token_list)
        return SampleOutput(token_list, logprobs, tokens, ended, deferred)

    def _constrain(self, plan: SamplerPlan, logits: torch.Tensor) -> dict[int, str]:
        """Apply bias, hold-backs and grammar masks in place; the rows whose grammar ended."""
        if plan.bias_index is not None:
            rows, ids, values = plan.bias_index
            logits.index_put_((rows, ids), values.to(logits.dtype), accumulate=True)
        if plan.suppress is not None:
            logits.index_put_(plan.suppress, torch.tensor(float("-inf"), dtype=logits.dtype))
        if plan.masks is None:
            return {}
        start = time.perf_counter()
        masks = plan.masks.result()
        apply_masks(logits, masks)
        self.grammar_wait_seconds += time.perf_counter() - start
        self.grammar_steps += 1
        return masks.ended

    def commit(self, step: ResourceStep, ctx: StepContext) -> None:
        """Record the tokens `sample` drew for this step: counters and penalty counts advance."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        plan, tokens, token_list, ended = pending
        segments = step.segments or ()
        if tuple(seg.request_id for seg in segments) != plan.request_ids:
            raise RuntimeError("sampler commit does not match the step its tokens were drawn for")
        pen_slots: list[int] = []
        pen_batch_rows: list[int] = []
        for i in plan.commit_rows:
            req = self._reqs.get(plan.request_ids[i])
            if req is None or i in ended:  # an ended grammar's row: its token is no output
                continue
            req.num_output += 1
            if req.matcher is not None and not req.matcher.accept_token(token_list[i]):
                req.grammar_broken = True
            if req.pen_row:
                pen_slots.append(req.pen_row)
                pen_batch_rows.append(i)
        if pen_slots:
            dev = self.device
            toks = tokens.index_select(0, to_device(pen_batch_rows, torch.int64, dev))
            rows = to_device(pen_slots, torch.int64, dev)
            self._counts.index_put_((rows, toks), torch.ones((), device=dev), accumulate=True)

    def cleanup(self) -> None:
        if self._masks is not None:
            self._masks.close()

    @property
    def mask_stats(self) -> dict[str, float]:
        """Grammar cost since start (the benchmark reads it): seconds filling masks on the
        worker and rows filled; seconds the sampler waited for and applied them, and steps."""
        fill, rows = (self._masks.fill_seconds, self._masks.rows_filled) if self._masks else (0, 0)
        return {
            "fill_seconds": fill,
            "rows_filled": rows,
            "wait_apply_seconds": self.grammar_wait_seconds,
            "steps": self.grammar_steps,
        }

    # -- internals -----------------------------------------------------------------------------
    def _draw(self, plan: SamplerPlan, x: torch.Tensor) -> torch.Tensor:
        """One token per row from softmax(x), x the processed logits (a work copy)."""
        if self._kernels is not None and plan.seeded_rows is None and x.stride(1) == 1:
            # One uniform per row, inverse CDF in C++: the same distribution as Gumbel-max
            # without noise for every vocab entry.
            u = torch.rand(x.shape[0], dtype=torch.float64, generator=self.generator)
            out: torch.Tensor = self._kernels.sample_rows(x, u)
            return out
        return self._argmax_rows(x.add_(self._noise_for(plan, x.shape[0])))

    def _argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernels is not None and x.dtype in cpu_kernels.DTYPES and x.stride(1) == 1:
            out: torch.Tensor = self._kernels.argmax_rows(x)
            return out
        return x.argmax(dim=1)

    def _process(
        self, plan: SamplerPlan, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, vocab = logits.shape
        if n != plan.num_rows:
            raise ValueError(f"logits have {n} rows, the plan {plan.num_rows}")
        if vocab != self.vocab_size:
            raise ValueError(f"logits have vocab {vocab}, the sampler {self.vocab_size}")
        if plan.all_greedy and plan.pen_rows is None:  # the fast path: nothing to rewrite
            return logits, self._argmax_rows(logits)
        if self._work.shape[0] < n:
            self._work = torch.empty((n, vocab), dtype=torch.float32, device=self.device)
        x = self._work[:n]
        x.copy_(logits)
        if plan.pen_rows is not None:
            assert plan.repetition is not None and plan.presence is not None
            assert plan.frequency is not None
            ops.apply_penalties_(
                x,
                self._counts.index_select(0, plan.pen_rows),
                self._prompt_mask.index_select(0, plan.pen_rows),
                plan.repetition,
                plan.presence,
                plan.frequency,
            )
        greedy_tok = self._argmax_rows(x) if plan.all_greedy or plan.greedy is not None else None
        if plan.all_greedy:
            return x, greedy_tok
        assert plan.temperature is not None
        x.div_(plan.temperature)
        if plan.top_k is not None or plan.top_p_cut is not None:
            ops.apply_top_k_top_p_(
                x, plan.top_k, plan.top_k_max, plan.top_p_cut, plan.top_p_in_top_k
            )
        if plan.log_min_p is not None:
            ops.apply_min_p_(x, plan.log_min_p)
        return x, greedy_tok

    def _noise_for(self, plan: SamplerPlan, n: int) -> torch.Tensor:
        if self._noise.shape[0] < n:
            self._noise = torch.empty((n, self.vocab_size), dtype=torch.float32, device=self.device)
        noise = self._noise[:n]
        if plan.any_random:
            ops.random_gumbel_(noise, self.generator)
        else:
            noise.zero_()
        if plan.seeded_rows is not None:
            assert plan.seeded_keys is not None
            if self._vhash is None:
                self._vhash = ops.vocab_hash(self.vocab_size, self.device)
            noise.index_copy_(0, plan.seeded_rows, ops.seeded_gumbel(plan.seeded_keys, self._vhash))
        return noise

    def _logprobs(
        self,
        plan: SamplerPlan,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        token_list: list[int],
    ) -> list[TokenLogprob | None] | None:
        if not plan.logprob_rows:
            return None
        rows = [r for r, _ in plan.logprob_rows]
        kmax = max(k for _, k in plan.logprob_rows)
        idx = to_device(rows, torch.int64, self.device)
        chosen_lp, top_v, top_i = ops.logprobs_of(
            logits.index_select(0, idx), tokens.index_select(0, idx), kmax
        )
        chosen_l: list[float] = chosen_lp.tolist()
        top_vl: list[list[float]] = top_v.tolist() if top_v is not None else []
        top_il: list[list[int]] = top_i.tolist() if top_i is not None else []
        out: list[TokenLogprob | None] = [None] * plan.num_rows
        for j, (row, k) in enumerate(plan.logprob_rows):
            top = tuple(zip(top_il[j][:k], top_vl[j][:k], strict=True)) if k else ()
            out[row] = TokenLogprob(token_list[row], chosen_l[j], top)
        return out
