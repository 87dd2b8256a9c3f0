"""`LLMEngine`: one step is schedule -> execute -> update.

The `Scheduler` owns admission (declare, admit through the `StepRunner`, answer refusals by
evicting, parking or failing, reload); the `ModelRunner` turns the admitted step into tensors
and runs the decoder and sampler; `Scheduler.update` commits it and produces the outputs. The
engine only builds these parts and checks requests at the door. It is single-threaded: the
server drives it from one thread. With `EngineConfig.async_scheduling` (on CUDA by default)
the `OverlapLoop` runs the same three calls with each step's tokens read one step late.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from mstar.engine.config import EngineConfig
from mstar.engine.deterministic import check_head_dim, deterministic_setup
from mstar.engine.executor import Executor, LocalExecutor, TensorParallelExecutor
from mstar.engine.lora.manager import LoraManager
from mstar.engine.model.config import ModelConfig
from mstar.engine.model.cuda_ops import attach_fused_glue_ops
from mstar.engine.model.decoder import Decoder
from mstar.engine.model.gguf_convert import default_model
from mstar.engine.model.gguf_quant import PLAIN, scan
from mstar.engine.model.loader import load_model, stored_gguf_refusal
from mstar.engine.model.tokenizer import Tokenizer
from mstar.engine.model_runner import ModelRunner
from mstar.engine.outputs import RequestOutput
from mstar.engine.overlap import OverlapLoop
from mstar.engine.parallel.group import LeaderRanks, start_leader
from mstar.engine.rank_resources import GIB, attention_resource, kv_pages, rank_kv_config
from mstar.engine.request import Request
from mstar.engine.resource_keys import ATTN, KV, LORA, ROPE, SAMPLER
from mstar.engine.resources.kv import KVCacheResource, KVRequestConfig
from mstar.engine.resources.positions import PositionsResource
from mstar.engine.resources.runner import StepRunner
from mstar.engine.resources.sampling import SamplerRequestConfig, SamplerResource
from mstar.engine.resources.sampling.grammar import GrammarBackend, InvalidGrammar
from mstar.engine.sampling_params import InvalidParameter, SamplingParams, context_overflow
from mstar.engine.scheduler import Scheduler, SchedulerConfig, SchedulerCounters
from mstar.kernels import BackendUnavailable, cpu_kernels, resolve_attention_backend
from mstar.kernels.cpu_gemm import cpu_prefers_bf16

log = logging.getLogger(__name__)

#: Step token budgets when --max-num-batched-tokens is unset (its help has the measurements).
#: The adaptive serving budget and offline batches take up to the default; a CPU server with
#: --step-budget fixed keeps steps short for TTFT.
DEFAULT_BATCHED_TOKENS = 2048
CPU_FIXED_SERVING_BATCHED_TOKENS = 512


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
        kv_dtype: torch.dtype | None = None,
        model_name: str,
        num_pages: int,
        host_offload_pages: int,
        serving: bool = False,
        ranks: LeaderRanks | None = None,
    ) -> None:
        """``ranks``: rank 0's side of a tensor-parallel replica (``decoder`` is then this
        rank's shard and ``decoder.config`` its heads); None: one rank. ``kv_dtype``: the KV
        cache's (`--kv-cache-dtype`; None: ``dtype``)."""
        self.decoder = decoder
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.config = config
        self.device = device
        self.dtype = dtype
        self.model_name = model_name
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        #: Steps that ran a batch, ever: a step that only held its requests moved nothing (the
        #: server's liveness check tells the two apart).
        self.executed_steps = 0

        local = decoder.config  # this rank's heads (all of them on one rank)
        self.kv = KVCacheResource(
            rank_kv_config(
                local,
                config,
                num_pages,
                kv_dtype or dtype,
                device,
                max_seq_len=self.max_model_len,
                host_offload_pages=host_offload_pages,
                enable_prefix_cache=config.enable_prefix_caching,
            )
        )
        #: Compiles structured-output grammars for this vocabulary (the server validates with it).
        self.grammar = GrammarBackend(
            tokenizer.backend.to_str(), model_config.vocab_size, tokenizer.eos_token_ids
        )
        sampler = SamplerResource(
            model_config.vocab_size,
            device=device,
            seed=config.seed,
            grammar=self.grammar,
            eos_token_ids=tokenizer.eos_token_ids,
        )
        attention = attention_resource(
            self.kv.cache, local, config, device, self.kv.cache.tensor.dtype
        )
        resources = {
            KV: self.kv,
            ATTN: attention,
            ROPE: PositionsResource(device),
            SAMPLER: sampler,
        }
        #: LoRA adapters served beside the base (`--enable-lora`, `--lora-modules`), or None
        self.lora: LoraManager | None = None
        if config.lora_enabled:  # never with ranks: `EngineConfig` refuses LoRA under TP
            self.lora = LoraManager(decoder, config.max_loras, config.max_lora_rank)
            self.lora.register_modules(config.lora_modules)
            if config.lora_modules_file is not None:
                self.lora.serve_file(config.lora_modules_file)
            resources[LORA] = self.lora.resource
        self.runner = StepRunner(resources)
        self.model_runner = ModelRunner(
            decoder,
            self.runner,
            sampler,
            device,
            preplan=config.enable_preplan,
            overlap=_overlaps(config, device, tensor_parallel=ranks is not None),
        )
        self.overlap = OverlapLoop(self) if self.model_runner.overlap else None
        self.scheduler = Scheduler(
            self.runner,
            self.kv,
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=_batched_tokens(config, device, serving),
                adaptive_budget=serving and config.step_budget == "adaptive",
                eviction_policy=config.eviction_policy,
                max_model_len=self.max_model_len,
                eos_token_ids=frozenset(tokenizer.eos_token_ids),
            ),
            make_context=self.model_runner.step_context,
        )
        self.executor: Executor = LocalExecutor(self.model_runner)
        if ranks is not None:
            self.executor = TensorParallelExecutor(self.model_runner, ranks)
        # Graphs hold no collectives; LoRA rows replay in them (`lora.cuda_graph_lora`).
        self.model_runner.setup_graphs(
            config.cuda_graph_batch_sizes,
            config.enforce_eager or ranks is not None,
            self.max_model_len,
        )

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: EngineConfig, *, serving: bool = False) -> LLMEngine:
        """Load the model and build the engine; ``serving``: behind the HTTP server (the step
        token budget's default differs, see `CPU_SERVING_BATCHED_TOKENS`)."""
        device = _pick_device(config.device)
        path = default_model(config.model)
        stored = _serves_stored(config, path, device)
        dtype = _pick_dtype(config.dtype, device, stored=stored)
        kv_dtype = _pick_kv_dtype(config.kv_cache_dtype, dtype, device, stored=stored)
        # Refuse an unavailable attention backend before spending time on the weights.
        backend = resolve_attention_backend(config.attention_backend, device, dtype)
        if config.deterministic:
            deterministic_setup(device, dtype, backend)
        ranks = start_leader(config, device) if config.tensor_parallel_size > 1 else None
        try:
            decoder, model_config, tokenizer = load_model(
                path,
                dtype=dtype,
                device=device,
                deterministic=config.deterministic,
                quantization=config.quantization,
                tp=None if ranks is None else ranks.group.tp,
            )
            if config.deterministic:
                check_head_dim(device, model_config.head_dim)
            attach_fused_glue_ops(decoder, device, dtype, config.deterministic)
            num_pages, bytes_per_page = kv_pages(config, model_config, device, kv_dtype)
            if ranks is not None:
                num_pages = ranks.group.agree_min(num_pages)
        except BaseException:
            if ranks is not None:
                if ranks.workers is not None:
                    ranks.workers.kill()
                ranks.group.leave()
            raise
        host_pages = int(config.host_offload_gb * GIB) // bytes_per_page
        if ranks is not None and host_pages:
            # The host tier copies rank 0's pages only; the other ranks' heads would be lost.
            log.info("tensor parallelism: host KV offload off (evicted requests recompute)")
            host_pages = 0
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
            kv_dtype=kv_dtype,
            model_name=name,
            num_pages=num_pages,
            host_offload_pages=host_pages,
            serving=serving,
            ranks=ranks,
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
        if request_id in self.scheduler.requests:
            raise InvalidParameter("request_id", f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidParameter("prompt", f"prompt token ids must be in [0, {vocab})")
        over = context_overflow(len(prompt_token_ids), params.max_tokens, self.max_model_len)
        if over is not None:
            raise InvalidParameter(*over)
        if any(t >= vocab for t in params.logit_bias):
            raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids < {vocab}")
        if params.grammar is not None:
            try:
                self.grammar.compile(params.grammar)  # cached: the server compiled it already
            except InvalidGrammar as exc:
                raise InvalidParameter("grammar", f"invalid grammar: {exc}") from exc
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            time.monotonic() if arrival_time is None else arrival_time,
        )
        req.overrides = {
            KV: KVRequestConfig(req.token_view),
            SAMPLER: SamplerRequestConfig(params, req.prompt_token_ids),
        }
        if params.lora_name is not None:
            if self.lora is None or not self.lora.pool.known(params.lora_name):
                raise InvalidParameter("model", f"no LoRA adapter {params.lora_name!r}")
            req.overrides[LORA] = params.lora_name
            salt = self.lora.pool.cache_salt(params.lora_name)
            req.overrides[KV] = KVRequestConfig(req.token_view, salt)
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> None:
        """Stop a request in any state; its pages (device and host) are freed at once."""
        self.scheduler.abort(request_id)

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the progress of every request that moved or ended."""
        if self.overlap is not None:
            return self.overlap.step()
        batch = self.scheduler.schedule()
        if batch is None:
            return self.scheduler.update(None, None)
        self.executed_steps += 1
        start = time.perf_counter()
        result = self.executor.execute(batch)
        self.scheduler.observe_cost(batch, time.perf_counter() - start)
        return self.scheduler.update(batch, result)

    def failure(self) -> str | None:
        """Why this engine can step no more (a tensor-parallel rank died); None: it can."""
        return self.executor.failure()

    def close(self) -> None:
        """Release the other ranks of a tensor-parallel replica (no-op on one rank)."""
        self.executor.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.offloaded)

    @property
    def counters(self) -> SchedulerCounters:
        return self.scheduler.counters

    def stats(self) -> EngineStats:
        """O(1): queue lengths and counters the KV cache maintains incrementally."""
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

    def generate(
        self, prompts: Iterable[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[list[int]]:
        """Offline batch generation: output token ids per prompt, in prompt order."""
        prompts = list(prompts)
        per = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"gen-{self.scheduler.step_index}-{i}" for i in range(len(prompts))]
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


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


def _pick_dtype(name: str, device: torch.device, *, stored: bool = False) -> torch.dtype:
    """``auto``: bf16 on CUDA, and on CPUs where it is the faster dtype (`cpu_prefers_bf16`:
    native bf16 math, or the kernels' FMA bf16 GEMM), where it halves the bytes each token
    reads; float32 where the kernels are off, the dtype whose greedy output is token-exact
    against transformers. ``stored`` (a GGUF whose projections stay in their blocks): float32
    on CPU, where the weights read the same bytes either way and a prompt's logits stay the
    dequantized model's (bf16 activations turned SmolLM2's answer to "What is the capital of
    France?" from "The capital of France is Paris." into "L'Étoile, ...": a near tie).
    """
    if name == "auto":
        if device.type == "cuda" or (not stored and cpu_prefers_bf16(cpu_kernels.load())):
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _pick_kv_dtype(
    name: str, dtype: torch.dtype, device: torch.device, *, stored: bool
) -> torch.dtype:
    """``auto``: bf16 for a GGUF served as stored under float32 activations on CPU (llama.cpp's
    default 16-bit cache; the float32 one was 360 of the default model's 900 MiB at 512 pages),
    else ``dtype``. A cache dtype other than ``dtype`` runs on CPU only (the attention casts
    around the CPU kernels). Logged once with its reason."""
    if name == "auto":
        if stored and device.type == "cpu" and dtype == torch.float32:
            log.info("KV cache: bfloat16 (auto: a GGUF served as stored, float32 activations)")
            return torch.bfloat16
        return dtype
    kv_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
    if kv_dtype != dtype and device.type != "cpu":
        raise BackendUnavailable(
            f"--kv-cache-dtype {name}: a cache dtype other than the activations' ({dtype}) "
            "is served on CPU only"
        )
    log.info("KV cache: %s (--kv-cache-dtype %s)", name, name)
    return kv_dtype


def _serves_stored(config: EngineConfig, path: str, device: torch.device) -> bool:
    """Whether ``path`` is a GGUF file the loader will keep in its blocks (its refusals
    before a dtype is chosen: `loader.stored_gguf_refusal`). A file of plain tensors only (a
    BF16 or F32 GGUF) keeps nothing in blocks: it is served like a checkpoint folder."""
    return (
        path.endswith(".gguf")
        and config.quantization == "auto"
        and stored_gguf_refusal(
            sharded=config.tensor_parallel_size > 1,
            device=device,
            dtype=None,
            kernels=cpu_kernels.load() if device.type == "cpu" else None,
            deterministic=config.deterministic,
        )
        is None
        and any(qtype not in PLAIN for _, qtype, _, _ in scan(path)[1])
    )


def _overlaps(config: EngineConfig, device: torch.device, *, tensor_parallel: bool) -> bool:
    """The overlap loop: asked for, or ``auto`` on CUDA (on CPU the forward runs on the
    calling thread, so launching ahead overlaps nothing). Never with tensor parallelism or
    LoRA: the step broadcast and the adapter rows hook the synchronous loop only."""
    mode = config.async_scheduling
    wanted = mode == "on" or (mode == "auto" and device.type == "cuda")
    blocker = "tensor parallelism" if tensor_parallel else "LoRA" if config.lora_enabled else None
    if wanted and blocker is not None:
        log.info("--async-scheduling %s: the overlap loop is off with %s", mode, blocker)
        return False
    return wanted


def _batched_tokens(config: EngineConfig, device: torch.device, serving: bool) -> int:
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    if serving and device.type == "cpu" and config.step_budget == "fixed":
        return CPU_FIXED_SERVING_BATCHED_TOKENS
    return DEFAULT_BATCHED_TOKENS
