"""The decoder every family runs, over a flat token batch.

The decoder knows nothing of requests, pages or the scheduler: a step hands it the tokens of
every scheduled sequence concatenated (prefill chunks and decode tokens mixed), their absolute
positions, an ``AttentionContext`` that owns the paged KV cache for this step, and the rows whose
logits the sampler needs. Its layers (`layers.DecoderLayer`) mirror transformers' models of
every registered family, so greedy decoding is token-identical in float32. A decode step runs
every layer in one `cpu_kernels.decode_layers` call (or `quant_decode_layers`, over GGUF blocks
as stored) where the family's layer shape is the one that kernel implements
(`fused_decode_refusal` names what is not).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from mstar.engine.model.config import ModelConfig, Rope
from mstar.engine.model.gguf_linear import QuantDecodeWeights
from mstar.engine.model.layers import (
    PROJECTIONS,
    AttentionContext,
    CosSin,
    DecoderLayer,
    RMSNorm,
)
from mstar.engine.model.linear import DenseLinearMethod, Linears, LinearSpec, MethodPicker
from mstar.engine.model.moe import FusedMoe, MoeBlock
from mstar.engine.model.rope import RotaryEmbedding
from mstar.kernels.cpu_gemm import PackedLinear
from mstar.kernels.paged_layout import KernelDecodeLayers

if TYPE_CHECKING:
    from mstar.engine.lora.layer import LoraRows

__all__ = [
    "AttentionContext",
    "Decoder",
    "FusedDecode",
    "FusedDecodeWeights",
    "RMSNorm",
    "fused_decode_refusal",
]


#: the gate activations `cpu_kernels.decode_layers` runs (SiLU; Gemma's GELU-tanh)
FUSED_ACTIVATIONS = ("silu", "gelu_tanh")


def fused_decode_refusal(cfg: ModelConfig, family_supports: bool = True) -> str | None:
    """Why `cpu_kernels.decode_layers` cannot run this model's layers (None: it can). That
    kernel runs a Llama block plus what Qwen3 and Gemma 3 add (q/k norm, ``1 + w`` and
    sandwich norms, GELU-tanh, per-layer RoPE tables, windows and KV groups) and the MoE
    layers of Qwen3-MoE, Mixtral and gpt-oss (with its sinks: `FusedMoe`): anything else is
    refused by name, never skipped inside it."""
    checks = (
        (not family_supports, f"the {cfg.family} layer"),
        (cfg.hidden_act not in FUSED_ACTIVATIONS, f"{cfg.hidden_act} activation"),
        # sinks ride on the MoE step's `MoeDecode` (gpt-oss), so a dense layer cannot take them
        (cfg.attn_sinks and cfg.moe is None, "attention sinks"),
    )
    reasons = [why for bad, why in checks if bad]
    return ", ".join(reasons) if reasons else None


@runtime_checkable
class KernelDecodeContext(Protocol):
    """An `AttentionContext` that can hand a decode-only step to `cpu_kernels.decode_layers`."""

    def kernel_decode(self) -> KernelDecodeLayers | None:
        """The step per KV group, the whole cache and where each layer reads, when every row
        decodes one token on the C++ kernels and the cache is contiguous; None otherwise."""
        ...


class FusedDecode(Protocol):
    """Every layer's weights for one C++ decode call: `FusedDecodeWeights` (packed float) or
    `gguf_linear.QuantDecodeWeights` (GGUF blocks as stored)."""

    @property
    def max_rows(self) -> int:
        """The most rows a step may have (past it, a projection's GEMM is another kernel)."""
        ...

    def kernel_call(self) -> tuple[str, tuple[Any, ...]]:
        """(the `cpu_kernels` function, the weights it takes after h and residual); the
        cache, RoPE tables, KV groups, layout and shapes follow them, the same for every
        bundle."""
        ...


@dataclass(frozen=True)
class FusedDecodeWeights:
    """Every layer's weights as `cpu_kernels.decode_layers` takes them (layers whose four
    projections all keep a small-batch packed weight), and the most rows those kernels take."""

    norm_in: list[torch.Tensor]
    norm_post: list[torch.Tensor]
    qkv: list[torch.Tensor]
    o: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    max_rows: int
    #: the MoE layers' router and experts (their gate/up and down entries are empty), or None
    moe: FusedMoe | None = None

    @staticmethod
    def gather(layers: Any) -> FusedDecodeWeights | None:
        """The bundle, or None where a layer runs a projection (or MoE block) another way."""
        packed: dict[str, list[torch.Tensor]] = {n: [] for n in PROJECTIONS}
        biases: list[torch.Tensor | None] = []
        max_rows = 1 << 30
        moe = None
        if any(layer.moe is not None or layer.sinks is not None for layer in layers):
            moe = FusedMoe.gather(layers)
            if moe is None:
                return None
            max_rows = moe.max_rows
        for layer in layers:
            for name in PROJECTIONS:
                if layer.moe is not None and name not in PROJECTIONS[:2]:
                    # the MoE step replaces the dense MLP's two projections (never read)
                    packed[name].append(torch.empty(0))
                    biases.append(None)
                    continue
                linear = getattr(layer, name)
                if not isinstance(linear, PackedLinear) or linear.small_batch_weight is None:
                    return None
                packed[name].append(linear.small_batch_weight)
                biases.append(None if linear.bias is None else linear.bias.detach())
                max_rows = min(max_rows, linear.small_batch_max_rows)
        return FusedDecodeWeights(
            norm_in=[layer.input_layernorm.weight.detach() for layer in layers],
            norm_post=[layer.mlp_norm.weight.detach() for layer in layers],
            qkv=packed["qkv_proj"],
            o=packed["o_proj"],
            gate_up=packed["gate_up_proj"],
            down=packed["down_proj"],
            biases=biases,
            max_rows=max_rows,
            moe=moe,
        )

    def kernel_call(self) -> tuple[str, tuple[Any, ...]]:
        weights = (self.norm_in, self.norm_post, self.qkv, self.o, self.gate_up, self.down)
        return "decode_layers", (*weights, self.biases)


class Decoder(nn.Module):
    """A causal LM of any registered family: ``forward`` returns model-dtype logits for the
    selected rows."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
        init_weights: bool = True,
        linear_method: MethodPicker | None = None,
    ) -> None:
        """``init_weights=False`` leaves weights uninitialised for a loader to fill (fast);
        ``linear_method`` picks each projection's `LinearMethod` (default: dense)."""
        super().__init__()
        self.config = cfg
        build_on = device if init_weights else "meta"
        # An explicit _weight skips normal_ init, which on meta tensors imports torch._dynamo.
        embed_init = None
        if not init_weights:
            embed_init = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device="meta")
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=embed_init, device=build_on, dtype=dtype
        )
        dense = DenseLinearMethod()
        #: every projection's spec and method (the linear seam, `mstar.engine.model.linear`)
        self.linears = Linears(linear_method or (lambda spec: dense))
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.linears, dtype, build_on) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, dtype, build_on, offset=cfg.norm_offset
        )
        head = LinearSpec("lm_head", cfg.hidden_size, cfg.vocab_size, False, "column")
        self.lm_head: nn.Module = self.linears.create(head, dtype, torch.device(build_on))
        if not init_weights:
            self._materialize(torch.device(device))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.requires_grad_(False)
        #: (parameters held, active per token), for the log and ``mstar:model_parameters``
        self.parameter_counts = self._count_parameters()
        #: `cpu_kernels.load()`'s extension for the float32 and bf16 glue ops, or None (torch ops)
        self.cpu_kernels: Any | None = None
        #: the first norm also takes the kernels' per-row pass (torch's reductions promise no
        #: per-row order across batch shapes); set with ``--deterministic``
        self.deterministic = False
        #: every layer's weights for `cpu_kernels.decode_layers` (`finalize_linears` gathers
        #: them where the layers allow it), or None: decode steps go layer by layer
        self.fused_decode: FusedDecode | None = None
        #: per layer, the norms the Llama block lacks (`DecoderLayer.layout_norms`, 4 each)
        self._layout_norms: list[torch.Tensor | None] = []
        #: `_layout_ints` per (windows, KV groups, cache slots) of a step, made once
        self._layout_ints: dict[tuple[tuple[int, ...], ...], list[int]] = {}
        #: the step's rows -> LoRA adapter slots when adapters are served (`lora.LoraManager`)
        self.lora_rows: LoraRows | None = None
        #: Gemma: embeddings times sqrt(hidden), the factor rounded to the model dtype first
        self.embed_scale: torch.Tensor | None = None
        if cfg.embed_scale:
            self.embed_scale = torch.tensor(cfg.hidden_size**0.5).to(dtype=dtype, device=device)
        positions = max_positions or cfg.max_position_embeddings
        #: one table per distinct RoPE (Gemma 3: local and global), shared by its layers
        self.layer_ropes = [cfg.rope_for(i) for i in range(cfg.num_layers)]
        self.ropes: dict[Rope, RotaryEmbedding] = {}
        for r in self.layer_ropes:
            if r not in self.ropes:
                self.ropes[r] = RotaryEmbedding(
                    cfg.head_dim, positions, r.theta, r.scaling, dtype=dtype, device=device
                )
        #: per layer, its table's index in `ropes` (the fused decode's cos / sin lists)
        self.rope_index = [list(self.ropes).index(r) for r in self.layer_ropes]

    def finalize_linears(self, picker: MethodPicker, fused: bool) -> None:
        """Swap every projection for its method's runtime module (after loading); ``fused``:
        gather `decode_layers`' weights where every layer's projections allow it."""
        self.linears.finalize(self, picker)
        self.fused_decode = None
        if fused:  # packed float weights, else GGUF blocks as stored
            gathered: FusedDecode | None = FusedDecodeWeights.gather(self.layers)
            if gathered is None and not any(layer.moe is not None for layer in self.layers):
                gathered = QuantDecodeWeights.gather(self.layers)  # (no MoE step over blocks)
            self.fused_decode = gathered
            layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
            self._layout_norms = [n for layer in layers for n in layer.layout_norms()]

    def _materialize(self, device: torch.device) -> None:
        """Swap meta parameters for empty real ones (Module.to_empty imports ~500 modules)."""
        for module in self.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    empty = torch.empty(p.shape, dtype=p.dtype, device=device)
                    module._parameters[name] = nn.Parameter(empty, requires_grad=False)

    def moe_blocks(self) -> list[MoeBlock]:
        """The MoE blocks of the layers that have one."""
        return [m for m in self.modules() if isinstance(m, MoeBlock)]

    def _count_parameters(self) -> tuple[int, int]:
        """(parameters held, parameters active per token): every weight but the experts
        (embeddings and LM head once when tied), plus each MoE block's `MoeSpec.params` with
        all its experts / its top-k. Counted at build, before `finalize_linears` and
        `MoeBlock.use_cpu_kernels` repack weights outside ``parameters()``."""
        dense = sum(p.numel() for n, p in self.named_parameters() if ".moe." not in n)
        specs = [block.spec for block in self.moe_blocks()]
        held = dense + sum(s.params(s.num_experts) for s in specs)
        return held, dense + sum(s.params(s.top_k) for s in specs)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @torch.no_grad()  # not inference_mode: callers may modify the returned logits in place
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionContext,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run tokens [T] at ``positions`` [T]; logits [n, vocab] for ``logits_indices`` [n]."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        # A fused-op provider may hand RoPE something else than gathered rows (`cuda_ops`).
        lookup = getattr(self.cpu_kernels, "rope_lookup", None)
        cos_sins = {
            r: lookup(table, positions) if lookup else table.lookup(positions)
            for r, table in self.ropes.items()
        }
        residual: torch.Tensor | None = None
        if self.cpu_kernels is not None and (self.deterministic or lookup is not None):
            # residual + x == x exactly: layer 0's first norm is the fused add+norm too (one
            # kernel and a fill on CUDA where torch's RMSNorm launches eight)
            residual = torch.zeros_like(hidden)
        last = len(self.layers) - 1
        # Only the sampled rows' last-layer output reaches the LM head: the rest of a prompt
        # chunk stops after the last attention (its K/V are all later steps need). That skips
        # o_proj and the MLP of one layer for nearly every prompt token (~2.8% of SmolLM2's
        # prefill FLOPs). Row-wise ops: the sampled rows' numbers do not change, except by
        # rounding where a GEMM picks its kernel by row count (`float32_packed_min_rows`,
        # `small_batch_kernel`).
        prune = last > 0 and logits_indices.shape[0] < input_ids.shape[0]
        fused = None if prune else self._fused_layers(attn, input_ids.shape[0])
        if fused is not None:
            hidden, residual = self._run_fused_layers(fused, hidden, residual, cos_sins)
        for i, layer in enumerate(self.layers if fused is None else ()):
            keep = logits_indices if prune and i == last else None
            rope = self.layer_ropes[i]
            hidden, residual = layer.forward(
                hidden, residual, self.ropes[rope], cos_sins[rope], attn, self.cpu_kernels, keep
            )
        if not prune:
            # Add and norm are row-wise, so doing them for the sampled rows only gives the
            # same numbers; indexing copies, so the in-place add touches neither full tensor.
            hidden = hidden[logits_indices]
            residual = residual[logits_indices] if residual is not None else None
        selected, _ = self.norm.add_forward(hidden, residual, self.cpu_kernels)
        # In the model's dtype, as the LM head computes them: an all-greedy batch's argmax
        # reads bf16 as is (widening is exact), and the sampler widens into its float32 work
        # buffer only where penalties, temperature or logprobs need float math. A float32
        # copy of b64's logits was ~3% of a bf16 decode step.
        logits: torch.Tensor = self.lm_head(selected)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _fused_layers(self, attn: AttentionContext, rows: int) -> KernelDecodeLayers | None:
        """The step where every layer can run in one `cpu_kernels.decode_layers` call: a
        decode step of at most the small-batch GEMMs' rows on the C++ kernels; None where the
        step goes layer by layer (which computes the same bits, one kernel call at a time)."""
        weights = self.fused_decode
        if self.cpu_kernels is None or weights is None or rows > weights.max_rows:
            return None
        if self.lora_rows is not None and not self.lora_rows.fused:
            return None  # a step with adapter rows decode_layers cannot add runs the layers
        return attn.kernel_decode() if isinstance(attn, KernelDecodeContext) else None

    def _run_fused_layers(
        self,
        step: KernelDecodeLayers,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sins: dict[Rope, CosSin],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer 0's first norm here (the layer path's), then every layer in one call."""
        weights, kernels, cfg = self.fused_decode, self.cpu_kernels, self.config
        assert weights is not None and kernels is not None
        first: RMSNorm = self.layers[0].input_layernorm  # type: ignore[assignment]
        h, residual = first.add_forward(hidden, residual, kernels)
        name, args = weights.kernel_call()
        tables = list(cos_sins.values())
        groups = step.steps
        moe = weights.moe if isinstance(weights, FusedDecodeWeights) else None
        lora = nullcontext() if self.lora_rows is None else self.lora_rows.fused_step()
        with lora, nullcontext() if moe is None else moe.step():
            out, residual = getattr(kernels, name)(
                h, residual, *args, step.cache, [c for c, _ in tables], [s for _, s in tables],
                [g.page_table for g in groups], [g.kv_lens for g in groups],
                [g.slots for g in groups], self._layout_norms, self._layout_ints_for(step),
                self.layers[0].gelu, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size,
                groups[0].scale, first.eps,
            )  # fmt: skip
        return out, residual

    def _layout_ints_for(self, step: KernelDecodeLayers) -> list[int]:
        """Per layer (RoPE table, window, KV group, cache slot), as `decode_layers` takes them."""
        key = (step.windows, step.layer_group, step.layer_slot)
        ints = self._layout_ints.get(key)
        if ints is None:
            per_layer = zip(self.rope_index, *key, strict=True)
            ints = self._layout_ints[key] = [v for layer in per_layer for v in layer]
        return ints
