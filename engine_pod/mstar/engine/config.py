"""Engine settings and their command-line flags: the one contract the CLI and the operator share.

The operator renders an `EngineConfig` into container args with `to_cli_args`; `mstar-engine
serve` parses the same flags back with `add_cli_args` / `from_namespace`. A round trip is lossless
(tested), so the two sides cannot drift. This module imports nothing heavy (no torch): the
operator image uses it too.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mstar.engine.lora.modules import parse_lora_module

EVICTION_POLICIES = ("lru", "priority")
ASYNC_SCHEDULING = ("auto", "on", "off")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
STEP_BUDGETS = ("adaptive", "fixed")
#: --quantization: "auto" serves quantized checkpoint weights as stored, "none" dequantizes,
#: "fp8" quantizes float weights to e4m3 at load (`model.fp8`)
QUANTIZATIONS = ("auto", "none", "fp8")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")
DEFAULT_CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _flag(help_text: str, **extra: Any) -> dict[str, Any]:
    return {"help": help_text, **extra}


@dataclass
class EngineConfig:
    """Everything `mstar-engine serve` can be told; field names are the flag names."""

    model: str | None = field(
        default=None,
        metadata=_flag(
            "Hugging Face checkpoint folder or GGUF file; unset serves the packaged SmolLM2 "
            "(its Q4_1 GGUF dequantized to --dtype; name the file to serve it as stored)."
        ),
    )
    served_model_name: str | None = field(
        default=None, metadata=_flag("Model id reported by /v1/models (default: derived).")
    )
    dtype: str = field(
        default="auto",
        metadata=_flag(
            "Weight and activation dtype (the KV cache's too, unless --kv-cache-dtype says). "
            "auto: bfloat16 on CUDA, on CPUs with native bf16 math "
            "(AVX512-BF16 or AMX) and on CPUs with FMA where the C++ kernels load (their bf16 "
            "GEMM reads half the bytes per token of float32: the faster choice); float32 "
            "where the kernels are off, and for a GGUF served as stored on CPU (its blocks read "
            "the same bytes either way). float32 greedy output is token-exact against "
            "transformers.",
            choices=DTYPES,
        ),
    )
    quantization: str = field(
        default="auto",
        metadata=_flag(
            "Quantized checkpoint weights. auto: served as stored (a GGUF file's Q8_0, Q4_0, "
            "Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K projections, on CPU with float32 or "
            "bfloat16 activations; other tensors dequantized; an FP8 checkpoint's e4m3 "
            "weights, FP8 GEMMs on CUDA); none: every weight dequantized to --dtype at load; "
            "fp8: a float checkpoint's layer projections quantized to e4m3 at load, one scale "
            "per output channel.",
            choices=QUANTIZATIONS,
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_flag(
            "KV cache dtype. auto: bfloat16 for a GGUF served as stored on CPU with float32 "
            "activations (llama.cpp's default 16-bit cache: half the KV memory), else --dtype. "
            "bfloat16 under float32 activations rounds k, v and q to bf16 for attention (CPU, "
            "one rank only); float32 keeps a float32 --dtype's greedy output token-exact.",
            choices=KV_CACHE_DTYPES,
        ),
    )
    device: str = field(default="auto", metadata=_flag("cuda when available.", choices=DEVICES))
    host: str = field(default="127.0.0.1", metadata=_flag("Address to listen on."))
    port: int = field(default=8000, metadata=_flag("Port to listen on."))
    num_pages: int | None = field(
        default=None, metadata=_flag("KV pages on the device (overrides the memory fraction).")
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=_flag("Fraction of free device memory given to the KV cache.")
    )
    page_size: int = field(default=16, metadata=_flag("Tokens per KV page."))
    max_num_seqs: int = field(default=64, metadata=_flag("Most requests in one step."))
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=_flag(
            "Most tokens in one step (prefill is chunked to fit); with --step-budget adaptive "
            "the cap of the measured budget. Default 2048. With --step-budget fixed on CPU the "
            "server defaults to 512, where a step's time grows with its tokens, so smaller "
            "chunks let prompts queued together start sooner (32 concurrent 128-token prompts, "
            "SmolLM2 on 2 cores: TTFT p50 3.2 s -> 1.3 s at the same output tokens/s)."
        ),
    )
    step_budget: str = field(
        default="adaptive",
        metadata=_flag(
            "How a serving step's token budget is chosen. adaptive: from the measured cost of "
            "steps, up to --max-num-batched-tokens: prompt chunks may stretch a step to a few "
            "times the running streams' decode step, and a queue of prompts is absorbed in as "
            "few steps as keeps its mean time to first token lowest (mstar.engine.step_budget). "
            "fixed: every step takes up to --max-num-batched-tokens tokens. Offline batches "
            "(no server) always use the fixed budget.",
            choices=STEP_BUDGETS,
        ),
    )
    max_model_len: int | None = field(
        default=None, metadata=_flag("Longest prompt + output (default: the model's).")
    )
    attention_backend: str = field(
        default="auto",
        metadata=_flag(
            "Paged attention kernels. flashinfer: FlashInfer's batch prefill/decode wrappers "
            "(CUDA, bfloat16/float16 only; the engine refuses to start if it is unavailable); "
            "torch: batched PyTorch SDPA (any device and dtype); auto: flashinfer on CUDA when "
            "importable and the dtype allows, else torch, and the choice is logged.",
            choices=ATTENTION_BACKENDS,
        ),
    )
    cuda_graph_batch_sizes: list[int] = field(
        default_factory=lambda: list(DEFAULT_CUDA_GRAPH_BATCH_SIZES),
        metadata=_flag(
            "Decode batch sizes captured as CUDA graphs at startup (CUDA + flashinfer backend "
            "only; two graphs per size). An all-decode step of n rows replays the smallest "
            "size >= n, its padding rows writing only the KV sink page; prefill or mixed steps "
            "and steps above the largest size run eager."
        ),
    )
    enforce_eager: bool = field(
        default=False,
        metadata=_flag("Capture no CUDA graphs: every step runs eager (graphs are CUDA-only)."),
    )
    enable_preplan: bool = field(
        default=True,
        metadata=_flag(
            "Plan step N+1's pre-planning resources (the sampler's row gather today) while step "
            "N's forward runs, promoted when the next step matches; greedy output is the same "
            "either way."
        ),
    )
    async_scheduling: str = field(
        default="auto",
        metadata=_flag(
            "Overlap loop: schedule and launch step N+1 before reading step N's tokens, which "
            "feed it from the device; the host reads tokens one step late (stops, max tokens "
            "and aborts stay exact: a finished request's extra token is discarded). auto: on "
            "for CUDA, off on CPU (where every op runs on the calling thread, so nothing "
            "overlaps).",
            choices=ASYNC_SCHEDULING,
        ),
    )
    eviction_policy: str = field(
        default="lru", metadata=_flag("Victim choice on KV shortage.", choices=EVICTION_POLICIES)
    )
    host_offload_gb: float = field(
        default=1.0, metadata=_flag("Host memory for offloaded KV pages, GiB (0 disables).")
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=_flag("Share whole KV pages between requests with one prefix.")
    )
    max_waiting_requests: int = field(
        default=256, metadata=_flag("Waiting-queue bound; beyond it requests get 429.")
    )
    shutdown_grace_seconds: float = field(
        default=30.0, metadata=_flag("On SIGTERM, how long in-flight requests may finish.")
    )
    stall_timeout_seconds: float = field(
        default=30.0,
        metadata=_flag(
            "The engine counts as hung when requests are pending and no step has moved any for "
            "the larger of this and 4 x the slowest step seen: /health and /ready answer 503 "
            "with the reason, in-flight requests end with an error and (with "
            "--exit-on-engine-failure) the server exits 1. 0 disables the check."
        ),
    )
    exit_on_engine_failure: bool = field(
        default=True,
        metadata=_flag(
            "Exit with status 1 within seconds when the engine loop dies or hangs (its requests "
            "already failed), so the pod restarts; --no-exit-on-engine-failure keeps the server "
            "up answering 503."
        ),
    )
    request_timeout_seconds: float = field(
        default=1800.0,
        metadata=_flag(
            "Every request's deadline, from arrival to its last byte; a body's 'timeout' "
            "(seconds) may shorten it. Past it the request ends with an error (504, or an error "
            "event and [DONE] in a stream) and its pages are freed. 0: no server-wide bound."
        ),
    )
    seed: int = field(default=0, metadata=_flag("Seed of the sampler's default generator."))
    deterministic: bool = field(
        default=False,
        metadata=_flag(
            "Batch-invariant numerics: a greedy or seeded request gives the same bits whatever "
            "shares its steps (batch, step budget and chunking, prefix-cache hits, recompute or "
            "offload). CPU: bf16 only, one GEMM kernel for every row count and one attention "
            "kernel for prompt and decode positions. CUDA (unverified, partial): FlashInfer "
            "without split-KV and torch's deterministic algorithms; cuBLAS GEMMs still pick "
            "kernels by batch size and prompt and decode positions take different attention "
            "kernels."
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=_flag(
            "Ranks one replica's model is sharded over (tensor parallelism: attention heads, MLP "
            "rows and vocabulary split, gloo on CPU, NCCL on CUDA), one per GPU, spread evenly "
            "over --nnodes pods; on one node the engine starts the other ranks itself. MoE "
            "models and GGUF-quantized projections are not sharded (refused / dequantized), "
            "and the host KV tier is off under it."
        ),
    )
    nnodes: int = field(
        default=1,
        metadata=_flag(
            "Pods (nodes) one replica's ranks run on; the one with --node-rank 0 serves HTTP, "
            "the others join its process group."
        ),
    )
    node_rank: int | None = field(
        default=None,
        metadata=_flag(
            "This pod's index among --nnodes (0, the default: the leader). In a LeaderWorkerSet "
            "the operator passes $(LWS_WORKER_INDEX)."
        ),
    )
    dist_init_addr: str | None = field(
        default=None,
        metadata=_flag(
            "HOST:PORT where the ranks of a multi-node replica meet (the leader's "
            "torch.distributed store); required with --nnodes above 1. In a LeaderWorkerSet the "
            "operator passes $(LWS_LEADER_ADDRESS):29500."
        ),
    )

    enable_lora: bool = field(
        default=False,
        metadata=_flag(
            "Serve LoRA adapters beside the base model (vLLM's flag; implied by --lora-modules "
            "and by loading adapters at run time through /v1/load_lora_adapter)."
        ),
    )
    lora_modules: list[str] = field(
        default_factory=list,
        metadata=_flag(
            "LoRA adapters served at start, each NAME=PATH (a PEFT folder: adapter_config.json "
            'and adapter_model.safetensors) or vLLM\'s JSON {"name": ..., "path": ..., '
            '"base_model_name": ...}; a request whose model is NAME uses that adapter.'
        ),
    )
    lora_modules_file: str | None = field(
        default=None,
        metadata=_flag(
            'A JSON file listing LoRA adapters in --lora-modules\' JSON form ([{"name": ..., '
            '"path": ...}, ...]; the operator mounts it from the engine ConfigMap): each is '
            "served, and the first --max-loras loaded, before the engine reports Ready."
        ),
    )
    max_loras: int = field(
        default=1,
        metadata=_flag(
            "Adapters resident at once (slots); a request for another waits while the least "
            "recently used idle adapter is evicted and its own is loaded."
        ),
    )
    max_lora_rank: int = field(
        default=16, metadata=_flag("Largest LoRA rank an adapter may have (slot size).")
    )

    def __post_init__(self) -> None:
        problems = self.validate()
        if problems:
            raise ValueError("; ".join(problems))

    def validate(self) -> list[str]:
        """Every problem with the settings, each naming its flag."""
        problems: list[str] = []
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "port"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"--{_dash(name)} must be >= 1")
        if self.num_pages is not None and self.num_pages < 2:
            problems.append("--num-pages must be >= 2")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            problems.append("--gpu-memory-utilization must be in (0, 1]")
        if self.max_model_len is not None and self.max_model_len < 1:
            problems.append("--max-model-len must be >= 1")
        if self.host_offload_gb < 0:
            problems.append("--host-offload-gb must be >= 0")
        if self.max_waiting_requests < 1:
            problems.append("--max-waiting-requests must be >= 1")
        for name in ("stall_timeout_seconds", "request_timeout_seconds"):
            if getattr(self, name) < 0:
                problems.append(f"--{_dash(name)} must be >= 0")
        problems += self._lora_problems()
        if any(bs < 1 for bs in self.cuda_graph_batch_sizes):
            problems.append("--cuda-graph-batch-sizes must all be >= 1")
        problems += self._parallel_problems()
        for name, allowed in (
            ("dtype", DTYPES),
            ("device", DEVICES),
            ("eviction_policy", EVICTION_POLICIES),
            ("attention_backend", ATTENTION_BACKENDS),
            ("step_budget", STEP_BUDGETS),
            ("quantization", QUANTIZATIONS),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
        ):
            if getattr(self, name) not in allowed:
                problems.append(f"--{_dash(name)} must be one of {', '.join(allowed)}")
        return problems

    def _parallel_problems(self) -> list[str]:
        if self.tensor_parallel_size < 1 or self.nnodes < 1:
            return ["--tensor-parallel-size and --nnodes must be >= 1"]
        problems: list[str] = []
        if self.tensor_parallel_size % self.nnodes:
            problems.append(
                f"--tensor-parallel-size ({self.tensor_parallel_size}) must be a multiple of "
                f"--nnodes ({self.nnodes}): every pod runs the same number of ranks"
            )
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            problems.append(f"--node-rank must be in [0, --nnodes) = [0, {self.nnodes})")
        if self.tensor_parallel_size > 1 and self.lora_enabled:
            problems.append("--enable-lora: not served with --tensor-parallel-size > 1")
        if self.tensor_parallel_size > 1 and self.kv_cache_dtype != "auto":
            problems.append("--kv-cache-dtype: not served with --tensor-parallel-size > 1")
        if self.tensor_parallel_size > 1 and self.quantization == "fp8":
            problems.append("--quantization fp8: not served with --tensor-parallel-size > 1")
        if self.nnodes > 1 and not self.dist_init_addr:
            problems.append("--dist-init-addr is required with --nnodes above 1")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                problems.append(f"--dist-init-addr must be HOST:PORT (got {self.dist_init_addr!r})")
        return problems

    @property
    def lora_enabled(self) -> bool:
        """Adapters are served: asked for by name, or implied by starting with some."""
        return self.enable_lora or bool(self.lora_modules) or self.lora_modules_file is not None

    def _lora_problems(self) -> list[str]:
        problems = [f"--{n} must be >= 1" for n in ("max-loras", "max-lora-rank")
                    if getattr(self, n.replace("-", "_")) < 1]  # fmt: skip
        for entry in self.lora_modules:
            try:
                parse_lora_module(entry)
            except ValueError as exc:
                problems.append(f"--lora-modules: {exc}")
        return problems


def _dash(name: str) -> str:
    return name.replace("_", "-")


def _fields() -> tuple[dataclasses.Field[Any], ...]:
    return dataclasses.fields(EngineConfig)


def add_cli_args(parser: argparse.ArgumentParser, *, positional_model: bool = True) -> None:
    """Register every `EngineConfig` field as a flag (model also as an optional positional)."""
    defaults = EngineConfig()
    for f in _fields():
        flag = f"--{_dash(f.name)}"
        default = getattr(defaults, f.name)
        # argparse %-formats help text (for %(default)s); the fields' prose means a literal %.
        help_text = f.metadata.get("help", "").replace("%", "%%")
        kwargs: dict[str, Any] = {"help": help_text, "dest": f.name}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if isinstance(default, bool):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, **kwargs
            )
        elif isinstance(default, list):
            item = str if "str" in str(f.type) else int
            parser.add_argument(flag, type=item, nargs="*", default=default, **kwargs)
        else:
            parser.add_argument(flag, type=_field_type(f), default=default, **kwargs)
    if positional_model:
        parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL")


def _field_type(f: dataclasses.Field[Any]) -> type:
    text = str(f.type)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


def from_namespace(ns: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(ns, f.name) for f in _fields() if hasattr(ns, f.name)}
    positional = getattr(ns, "model_positional", None)
    if positional is not None:
        values["model"] = positional
    return EngineConfig(**values)


def to_cli_args(config: EngineConfig, *, explicit: bool = False) -> list[str]:
    """Flags reproducing `config`, in field order: those that differ from the defaults, or with
    `explicit` every field that has a value (the operator's choice: an engine image whose defaults
    differ must not silently change a deployment). Unset optional fields (None) have no flag."""
    defaults = EngineConfig()
    args: list[str] = []
    for f in _fields():
        value = getattr(config, f.name)
        if value is None or (not explicit and value == getattr(defaults, f.name)):
            continue
        flag = f"--{_dash(f.name)}"
        if isinstance(value, bool):
            args.append(flag if value else f"--no-{_dash(f.name)}")
        elif isinstance(value, list):
            args.append(flag)
            args.extend(str(v) for v in value)
        else:
            args.extend([flag, str(value)])
    return args


def parse_cli_args(argv: list[str]) -> EngineConfig:
    """Parse engine flags alone (what the operator renders) back into a config."""
    parser = argparse.ArgumentParser(prog="mstar-engine serve")
    add_cli_args(parser)
    return from_namespace(parser.parse_args(argv))
