"""`LLMEngine`: one step = declare -> admit -> plan -> forward -> sample -> commit.

The engine owns the resources (kv, attn, rope, sampler) behind one `StepRunner` and answers each
admission refusal by its type:

- `AllocationFailed`: evict a victim holding pages on the failing resource (LRU by last step, or
  PRIORITY via `get_offload_priority`), preferring requests outside the batch. Offload it to host
  memory; when the host pool cannot take it, drop its KV and recompute it later (its tokens stay).
  Then schedule again.
- `RequestOffloading`: the request is on the host; park it until reload, evict nothing.
- `AdmitRuntimeError`: fail that request with the resource's message; the others go on.

Every request ends finished, failed with a reason, or aborted; removal frees all its pages
(device and host) at once. The engine is single-threaded: the server drives it from one thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mstar.engine.config import EngineConfig
from mstar.engine.model.config import ModelConfig
from mstar.engine.model.decoder import Decoder
from mstar.engine.model.gguf_convert import default_model_path
from mstar.engine.model.loader import load_model
from mstar.engine.model.tokenizer import Tokenizer
from mstar.engine.outputs import ErrorKind, FinishReason, RequestError, RequestOutput
from mstar.engine.request import Request, RequestStatus
from mstar.engine.resources.attention import AttentionResource
from mstar.engine.resources.kv import KVCacheResource, KVConfig, KVRequestConfig
from mstar.engine.resources.positions import PositionsResource
from mstar.engine.resources.runner import StepRunner
from mstar.engine.resources.sampling import SamplerRequestConfig, SamplerResource
from mstar.engine.resources.step import (
    AdmitRuntimeError,
    AllocationFailed,
    FullAdmitOutcome,
    RequestOffloading,
    ResourceStep,
    Segment,
    StepContext,
    SubmoduleStep,
)
from mstar.engine.sampling_params import InvalidParameter, SamplingParams
from mstar.engine.scheduler import ScheduledRow, Scheduler, choose_victim
from mstar.kernels import select_attention_backend

log = logging.getLogger(__name__)

KV, ATTN, ROPE, SAMPLER = "kv", "attn", "rope", "sampler"
LABEL = "main"
#: How long an evicted victim is left alone before it may reload (avoids offload ping-pong).
HOLD_BACKOFF_SECONDS = 0.05
#: Refusals answered within one step before giving the step up.
MAX_ADMIT_ATTEMPTS = 16
GIB = 1 << 30
CPU_DEFAULT_KV_BYTES = 1 * GIB


@dataclass(frozen=True)
class EngineStats:
    """Gauges and cumulative counters the server exports."""

    num_running: int
    num_waiting: int
    num_offloaded: int
    kv_usage: float
    host_kv_usage: float
    prefix_queries: int
    prefix_hits: int
    num_free_pages: int
    num_pages: int


@dataclass
class EngineCounters:
    """Cumulative scheduler counts (tests assert that eviction paths really ran)."""

    admit_failures: int = 0
    offloads: int = 0
    reloads: int = 0
    recomputations: int = 0


class LLMEngine:
    def __init__(
        self,
        decoder: Decoder,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        config: EngineConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        model_name: str,
        num_pages: int,
        host_offload_pages: int,
    ) -> None:
        self.decoder = decoder
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.config = config
        self.device = device
        self.dtype = dtype
        self.model_name = model_name
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)

        self.kv = KVCacheResource(
            KVConfig(
                num_layers=model_config.num_layers,
                num_kv_heads=model_config.num_kv_heads,
                head_dim=model_config.head_dim,
                num_pages=num_pages,
                page_size=config.page_size,
                dtype=dtype,
                device=str(device),
                max_seq_len=self.max_model_len,
                host_offload_pages=host_offload_pages,
                enable_prefix_cache=config.enable_prefix_caching,
            )
        )
        self.sampler = SamplerResource(model_config.vocab_size, device=device, seed=config.seed)
        attention = AttentionResource(
            self.kv.cache,
            select_attention_backend(device),
            num_qo_heads=model_config.num_heads,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
        )
        self.runner = StepRunner(
            {
                KV: self.kv,
                ATTN: attention,
                ROPE: PositionsResource(device),
                SAMPLER: self.sampler,
            }
        )
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens)
        self.counters = EngineCounters()
        self._requests: dict[str, Request] = {}
        self._finished: list[Request] = []
        self._step_index = 0
        self._priority = config.eviction_policy == "priority"

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        device = _pick_device(config.device)
        dtype = _pick_dtype(config.dtype, device)
        path = config.model or str(default_model_path())
        decoder, model_config, tokenizer = load_model(path, dtype=dtype, device=device)
        bytes_per_page = (
            model_config.kv_elements_per_token
            * config.page_size
            * torch.empty((), dtype=dtype).element_size()
        )
        num_pages = config.num_pages or _default_num_pages(config, device, bytes_per_page)
        host_pages = int(config.host_offload_gb * GIB) // bytes_per_page
        name = config.served_model_name or (
            "SmolLM2-135M-Instruct" if config.model is None else path.rstrip("/").split("/")[-1]
        )
        return cls(
            decoder,
            model_config,
            tokenizer,
            config,
            device=device,
            dtype=dtype,
            model_name=name,
            num_pages=num_pages,
            host_offload_pages=host_pages,
        )

    # -- public API ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises `InvalidParameter` for what can never run (checked up front)."""
        if request_id in self._requests:
            raise InvalidParameter("request_id", f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidParameter("prompt", f"prompt token ids must be in [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if len(prompt_token_ids) >= self.max_model_len or total > self.max_model_len:
            raise InvalidParameter(
                "max_tokens" if len(prompt_token_ids) < self.max_model_len else "prompt",
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request has {len(prompt_token_ids)} prompt tokens and asks for "
                f"{params.max_tokens} more",
            )
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            time.monotonic() if arrival_time is None else arrival_time,
        )
        req.overrides = {
            KV: KVRequestConfig(req.token_ids),
            SAMPLER: SamplerRequestConfig(params, req.prompt_token_ids),
        }
        self.runner.ingest_request(request_id, req.overrides)
        self._requests[request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> None:
        """Stop a request in any state; its pages (device and host) are freed at once."""
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return
        self._finish(req, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return len(self.scheduler) > 0 or bool(self._finished)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.offloaded)

    def stats(self) -> EngineStats:
        kv = self.kv
        return EngineStats(
            num_running=self.num_running(),
            num_waiting=self.num_waiting(),
            num_offloaded=len(self.scheduler.offloaded),
            kv_usage=kv.usage,
            host_kv_usage=kv.host_usage,
            prefix_queries=kv.prefix_queries,
            prefix_hits=kv.prefix_hits,
            num_free_pages=kv.num_free_pages,
            num_pages=kv.num_pages,
        )

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the progress of every request that moved or ended."""
        self._step_index += 1
        now = time.monotonic()
        self._reload_offloaded(now)
        admitted = self._admit_batch()
        if admitted is not None:
            self._execute(*admitted)
        return self._collect_outputs()

    def generate(
        self, prompts: Iterable[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[list[int]]:
        """Offline batch generation: output token ids per prompt, in prompt order."""
        prompts = list(prompts)
        per = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"gen-{self._step_index}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, per, strict=True):
            self.add_request(rid, prompt, p)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        errors: dict[str, str] = {}
        while self.has_unfinished_requests():
            for o in self.step():
                out[o.request_id].extend(o.new_token_ids)
                if o.error is not None:
                    errors[o.request_id] = o.error.message
        if errors:
            raise RuntimeError(f"requests failed: {errors}")
        return [out[rid] for rid in ids]

    # -- admission -----------------------------------------------------------------------------
    def _declare(self, rows: list[ScheduledRow]) -> tuple[SubmoduleStep, list[int]]:
        """The step over `rows`, and the indices of the rows that sample a token this step."""
        segments = [Segment(r.request.request_id, LABEL, r.num_tokens) for r in rows]
        steps: dict[str, ResourceStep] = {
            KV: ResourceStep(),
            ATTN: ResourceStep(),
            ROPE: ResourceStep(),
        }
        # Rows that finish their known tokens sample; the sampler reuses their segments.
        sample_rows = [i for i, r in enumerate(rows) if r.num_tokens == r.request.num_uncomputed]
        if sample_rows:
            steps[SAMPLER] = ResourceStep(tuple(segments[i] for i in sample_rows))
        step = SubmoduleStep(steps, segments)
        step.set_ctx(StepContext([s.request_id for s in segments], "llm", 0, False))
        return step, sample_rows

    def _admit_batch(self) -> tuple[list[ScheduledRow], SubmoduleStep, list[int]] | None:
        for _ in range(MAX_ADMIT_ATTEMPTS):
            now = time.monotonic()
            rows = self.scheduler.schedule(now)
            if not rows:
                return None
            if self._match_prefixes(rows):  # cached tokens shrink what is left to compute
                rows = [
                    ScheduledRow(r.request, min(r.num_tokens, r.request.num_uncomputed))
                    for r in rows
                ]
            step, sample_rows = self._declare(rows)
            outcome = self.runner.admit(step)
            if outcome.ok:
                for r in rows:
                    self.scheduler.mark_running(r.request)
                return rows, step, sample_rows
            self._handle_refusal(outcome, rows, now)
        return None

    def _match_prefixes(self, rows: list[ScheduledRow]) -> bool:
        """Reuse cached prefix pages for rows about to (re)prefill; True if any matched."""
        if not self.config.enable_prefix_caching:
            return False
        hit = False
        for r in rows:
            req = r.request
            if req.num_computed == 0 and req.status is RequestStatus.WAITING:
                matched = self.kv.match_prefix(req.request_id, req.token_ids)
                req.num_computed = matched
                req.num_cached_tokens = max(req.num_cached_tokens, matched)
                hit = hit or matched > 0
        return hit

    def _handle_refusal(
        self, outcome: FullAdmitOutcome, rows: list[ScheduledRow], now: float
    ) -> None:
        reason = outcome.reason
        resource = outcome.failed_resource or "?"
        self.counters.admit_failures += 1
        blamed = self._requests.get(getattr(reason, "request_id", ""))
        attrs: dict[str, Any] = {
            "reason": type(reason).__name__,
            "resource": resource,
            "message": reason.message if reason is not None else "",
        }
        if isinstance(reason, AllocationFailed):
            attrs.update(pages_short=reason.pages_short, label=reason.label)
        if isinstance(reason, AdmitRuntimeError):
            culprit = self._isolate_terminal_refusal(rows)
            if culprit is not None:
                culprit.event("admit_refused", now, **attrs)
                self._fail(
                    culprit,
                    RequestError(
                        ErrorKind.REJECTED,
                        f"resource {resource} rejected the request: {reason.message}",
                        resource,
                    ),
                )
            return
        target = blamed or rows[-1].request
        target.event("admit_refused", now, **attrs)
        if isinstance(reason, RequestOffloading):
            if target.status is not RequestStatus.OFFLOADED:
                self.scheduler.mark_offloaded(target)
            return
        self._evict_for(resource, rows, target, now)

    def _evict_for(
        self, resource: str, rows: list[ScheduledRow], blamed: Request, now: float
    ) -> None:
        batch_ids = {r.request.request_id for r in rows}
        candidates = [
            req
            for req in self.scheduler.requests()
            if req.status is not RequestStatus.OFFLOADED
            and self.runner.reclaimable(req.request_id, [resource]) > 0
        ]
        priority = None
        if self._priority:

            def priority(r: Request) -> float:
                return self.runner.offload_priority(r.request_id, [resource])

        victim = choose_victim(candidates, batch_ids, priority)
        if victim is None:
            blamed.hold_until = now + HOLD_BACKOFF_SECONDS
            return
        freed = self.runner.offload(victim.request_id, [resource])
        victim.hold_until = now + HOLD_BACKOFF_SECONDS
        if freed > 0:
            self.counters.offloads += 1
            self.scheduler.mark_offloaded(victim)
            victim.event("evicted", now, resource=resource, pages=freed, mode="offload")
            victim.event("offloaded", now, resource=resource, pages=freed)
            return
        # The host pool cannot take it: drop its KV, keep its tokens, prefill it again later.
        res = self.runner.resources[resource]
        pages = res.reclaimable(victim.request_id)
        res.remove_request(victim.request_id)
        res.ingest_request(victim.request_id, victim.overrides.get(resource))
        self.counters.recomputations += 1
        self.scheduler.requeue_for_recompute(victim)
        victim.event("evicted", now, resource=resource, pages=pages, mode="recompute")
        victim.event("recomputed", now, resource=resource, tokens=len(victim.token_ids))

    def _isolate_terminal_refusal(self, rows: list[ScheduledRow]) -> Request | None:
        """A batch refusal that no eviction cures: find which row can never be served."""
        if len(rows) == 1:
            return rows[0].request
        for r in rows:
            probe, _ = self._declare([r])
            outcome = self.runner.admit(probe)
            if outcome.ok:
                self.runner.abort_step(probe)
            elif isinstance(outcome.reason, AdmitRuntimeError):
                return r.request
        return None

    def _reload_offloaded(self, now: float) -> None:
        for req in list(self.scheduler.offloaded):
            if req.hold_until > now:
                continue
            if not self.runner.reload(req.request_id):
                break  # FCFS: a younger victim must not jump ahead of an older one
            self.counters.reloads += 1
            req.last_active_step = self._step_index
            req.event("reloaded", now)
            self.scheduler.mark_running(req)

    # -- execution -----------------------------------------------------------------------------
    def _execute(
        self, rows: list[ScheduledRow], step: SubmoduleStep, sample_rows: list[int]
    ) -> None:
        now = time.monotonic()
        try:
            plans = self.runner.plan(step)
            input_ids = torch.tensor(
                [
                    t
                    for r in rows
                    for t in r.request.token_ids[
                        r.request.num_computed : r.request.num_computed + r.num_tokens
                    ]
                ],
                dtype=torch.long,
            ).to(self.device, non_blocking=True)
            kv_plan = plans[KV]
            ends = kv_plan.qo_indptr[1:].tolist()
            logits_indices = torch.tensor([ends[i] - 1 for i in sample_rows], dtype=torch.long)
            with torch.inference_mode():
                logits = self.decoder(
                    input_ids, plans[ROPE], plans[ATTN], logits_indices.to(self.device)
                )
                sampled = self.sampler.sample(plans[SAMPLER], logits) if sample_rows else None
            self.runner.commit(step)
        except Exception:
            log.exception("step failed; aborting the batch's requests")
            self.runner.abort_step(step)
            for r in rows:
                self._fail(
                    r.request,
                    RequestError(ErrorKind.INTERNAL, "internal error while running the model"),
                )
            return
        for r in rows:
            req = r.request
            req.num_computed += r.num_tokens
            req.last_active_step = self._step_index
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        if sampled is None:
            return
        done = time.monotonic()
        for j, i in enumerate(sample_rows):
            req = rows[i].request
            token = sampled.token_ids[j]
            req.token_ids.append(token)
            req.pending_tokens.append(token)
            logprob = None if sampled.logprobs is None else sampled.logprobs[j]
            if logprob is not None:
                req.pending_logprobs.append(logprob)
            if req.first_token_time is None:
                req.first_token_time = done
            reason = self._stop_reason(req, token)
            if reason is not None:
                self._finish(req, reason)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        if (
            not params.ignore_eos and token in self.eos_token_ids
        ) or token in params.stop_token_ids:
            return FinishReason.STOP
        if req.num_output_tokens >= params.max_tokens or len(req.token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    # -- endings -------------------------------------------------------------------------------
    def _fail(self, req: Request, error: RequestError) -> None:
        req.error = error
        self._finish(req, FinishReason.ERROR)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.discard(req)
        self.runner.remove_request(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finished_time = time.monotonic()
        self._finished.append(req)

    def _collect_outputs(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for req in self.scheduler.requests():
            if req.pending_tokens or req.pending_events:
                outputs.append(self._output(req))
        for req in self._finished:
            outputs.append(self._output(req))
            del self._requests[req.request_id]
        self._finished.clear()
        return outputs

    def _output(self, req: Request) -> RequestOutput:
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=req.pending_tokens,
            new_logprobs=req.pending_logprobs if req.params.logprobs is not None else None,
            finished=req.finished,
            finish_reason=req.finish_reason,
            error=req.error,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            events=req.pending_events,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finished_time=req.finished_time,
        )
        req.pending_tokens, req.pending_logprobs, req.pending_events = [], [], []
        return out


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _default_num_pages(config: EngineConfig, device: torch.device, bytes_per_page: int) -> int:
    """Pages from free device memory on CUDA; a fixed host budget on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization)
    else:
        budget = CPU_DEFAULT_KV_BYTES
    return max(2, budget // bytes_per_page)
