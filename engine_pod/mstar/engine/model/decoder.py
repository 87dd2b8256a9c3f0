"""Llama / Qwen2 decoder over a flat token batch.

The decoder knows nothing of requests, pages or the scheduler: a step hands it the tokens of
every scheduled sequence concatenated (prefill chunks and decode tokens mixed), their absolute
positions, an ``AttentionContext`` that owns the paged KV cache for this step, and the rows whose
logits the sampler needs. The math mirrors transformers' LlamaForCausalLM / Qwen2ForCausalLM
(HF RMSNorm with float32 upcast, rotate_half RoPE) so greedy decoding is token-identical in
float32. Q/K/V and gate/up projections are fused into one matmul each, which is what makes a
small model fast on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from mstar.engine.model.config import ModelConfig
from mstar.engine.model.rope import RotaryEmbedding
from mstar.kernels import cpu_kernels
from mstar.kernels.cpu_gemm import PackedLinear
from mstar.kernels.paged_attention import KernelDecodeStep


class AttentionContext(Protocol):
    """Per-step attention over the paged KV cache (the engine implements it)."""

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Write k/v [T, Hkv, D] for ``layer_idx`` into the cache, return attention [T, Hq, D]."""
        ...


#: `RotaryEmbedding.lookup`'s (cos, sin) at a step's positions
CosSin = tuple[torch.Tensor, torch.Tensor]


@runtime_checkable
class KernelDecodeContext(Protocol):
    """An `AttentionContext` that can hand a decode-only step to `cpu_kernels.decode_layers`."""

    def kernel_decode(self) -> tuple[KernelDecodeStep, torch.Tensor] | None:
        """(the step, the whole cache [layers, pages, 2, S, Hkv, D]) when every row decodes
        one token on the C++ kernels and the cache is contiguous; None otherwise."""
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

    @staticmethod
    def gather(layers: Any) -> FusedDecodeWeights | None:
        """The bundle, or None where a layer runs a projection another way."""
        names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        packed: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        biases: list[torch.Tensor | None] = []
        max_rows = 1 << 30
        for layer in layers:
            for name in names:
                linear = getattr(layer, name)
                if not isinstance(linear, PackedLinear) or linear.small_batch_weight is None:
                    return None
                packed[name].append(linear.small_batch_weight)
                biases.append(None if linear.bias is None else linear.bias.detach())
                max_rows = min(max_rows, linear.small_batch_max_rows)
        return FusedDecodeWeights(
            norm_in=[layer.input_layernorm.weight.detach() for layer in layers],
            norm_post=[layer.post_attention_layernorm.weight.detach() for layer in layers],
            qkv=packed["qkv_proj"],
            o=packed["o_proj"],
            gate_up=packed["gate_up_proj"],
            down=packed["down_proj"],
            biases=biases,
            max_rows=max_rows,
        )


class RMSNorm(nn.Module):
    """HF RMSNorm: normalise in float32, cast back, then scale in the input dtype."""

    def __init__(
        self,
        size: int,
        eps: float,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused pass; bit-identical to the three-step form below in float32 (checked
            # against transformers by the exactness tests), ~6 elementwise passes fewer.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, kernels: Any | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); with no residual yet, x is the residual.

        Overwrites ``x`` (a sublayer's fresh output), and ``residual`` on the kernel path, where
        `cpu_kernels.add_rms_norm_` does the add and the norm in one pass over the rows
        (float32 or bf16).
        """
        if residual is None:
            return self(x), x
        if kernels is not None and x.dtype in cpu_kernels.DTYPES:
            kernels.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = x.add_(residual)
        return self(residual), residual


def pack_linears_(
    decoder: Decoder,
    *,
    float32_gemm: bool = False,
    kernels: Any | None = None,
    deterministic: bool = False,
) -> None:
    """Swap every projection and the LM head for a `PackedLinear` (see `can_pack`);
    ``deterministic``: each runs one row-invariant kernel for every batch (see `PackedLinear`)."""

    def pack(linear: nn.Linear) -> PackedLinear:
        return PackedLinear(
            linear, float32_gemm=float32_gemm, kernels=kernels, deterministic=deterministic
        )

    for layer in decoder.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            linear = getattr(layer, name)
            if isinstance(linear, nn.Linear):
                setattr(layer, name, pack(linear))
    if isinstance(decoder.lm_head, nn.Linear):
        decoder.lm_head = pack(decoder.lm_head)
    decoder.fused_decode = (
        FusedDecodeWeights.gather(decoder.layers) if kernels is not None else None
    )


class DecoderLayer(nn.Module):
    """One pre-norm transformer block with fused QKV and fused gate/up projections."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.inter = cfg.intermediate_size
        hidden = cfg.hidden_size
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device)
        qkv_out = self.q_size + 2 * self.kv_size
        self.qkv_proj: nn.Module = nn.Linear(
            hidden, qkv_out, cfg.qkv_bias, device=device, dtype=dtype
        )
        self.o_proj: nn.Module = nn.Linear(
            self.q_size, hidden, cfg.o_bias, device=device, dtype=dtype
        )
        self.gate_up_proj: nn.Module = nn.Linear(
            hidden, 2 * self.inter, cfg.mlp_bias, device=device, dtype=dtype
        )
        self.down_proj: nn.Module = nn.Linear(
            self.inter, hidden, cfg.mlp_bias, device=device, dtype=dtype
        )

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryEmbedding,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionContext,
        kernels: Any | None = None,
        keep_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual): the residual add is left to the next norm, which fuses it.

        ``hidden`` is the previous layer's MLP output (the embeddings, with ``residual`` None,
        for layer 0); ``cos_sin`` is `RotaryEmbedding.lookup` at this step's positions, shared
        by all layers; ``kernels`` is `cpu_kernels.load()`'s extension or None (torch ops).
        ``keep_rows``: after attention (which writes every row's K/V), only these rows go on
        through o_proj and the MLP, and only theirs are returned.
        """
        t = hidden.shape[0]
        h, residual = self.input_layernorm.add_forward(hidden, residual, kernels)
        # Submodules' ``forward`` called directly and views by slicing: a decode step is ~30
        # Python ops per layer around the kernels, and nn.Module.__call__ and Tensor.split's
        # Python wrapper were a third of that (measured at batch 1, where they show most).
        qkv = self.qkv_proj.forward(h)
        # Q and K sit side by side in each row, so one rotation covers both.
        qk_size = self.q_size + self.kv_size
        qk = qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        rope.rotate_(qk, *cos_sin, kernels=kernels)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        o = attn.attend(self.layer_idx, q, k, v).reshape(t, self.q_size)
        if keep_rows is not None:
            assert residual is not None  # not the first layer
            o, residual = o[keep_rows], residual[keep_rows]
        h = self.o_proj.forward(o)
        x, residual = self.post_attention_layernorm.add_forward(h, residual, kernels)
        gate_up = self.gate_up_proj.forward(x)
        if kernels is not None and gate_up.dtype in cpu_kernels.DTYPES:
            return self.down_proj.forward(kernels.silu_mul(gate_up)), residual
        gate, up = gate_up[:, : self.inter], gate_up[:, self.inter :]
        # In place on fresh temporaries: two fewer allocations of [T, inter] per layer.
        return self.down_proj.forward(F.silu(gate).mul_(up)), residual


class Decoder(nn.Module):
    """Llama/Qwen2 causal LM: ``forward`` returns model-dtype logits for the selected rows."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
        init_weights: bool = True,
    ) -> None:
        """``init_weights=False`` leaves weights uninitialised for a loader to fill (fast)."""
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
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, build_on) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, build_on)
        self.lm_head: nn.Module = nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, device=build_on, dtype=dtype
        )
        if not init_weights:
            self._materialize(torch.device(device))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.requires_grad_(False)
        #: `cpu_kernels.load()`'s extension for the float32 and bf16 glue ops, or None (torch ops)
        self.cpu_kernels: Any | None = None
        #: the first norm also takes the kernels' per-row pass (torch's reductions promise no
        #: per-row order across batch shapes); set with ``--deterministic``
        self.deterministic = False
        #: every layer's weights for `cpu_kernels.decode_layers` (`pack_linears_` gathers them
        #: where the layers allow it), or None: decode steps go layer by layer
        self.fused_decode: FusedDecodeWeights | None = None
        self.rope = RotaryEmbedding(
            cfg.head_dim,
            max_positions or cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
            dtype=dtype,
            device=device,
        )

    def _materialize(self, device: torch.device) -> None:
        """Swap meta parameters for empty real ones (Module.to_empty imports ~500 modules)."""
        for module in self.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    empty = torch.empty(p.shape, dtype=p.dtype, device=device)
                    module._parameters[name] = nn.Parameter(empty, requires_grad=False)

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
        cos_sin = self.rope.lookup(positions)
        residual: torch.Tensor | None = None
        if self.deterministic and self.cpu_kernels is not None:
            residual = torch.zeros_like(hidden)  # residual + x == x exactly
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
            hidden, residual = self._run_fused_layers(*fused, hidden, residual, cos_sin)
        for i, layer in enumerate(self.layers if fused is None else ()):
            keep = logits_indices if prune and i == last else None
            hidden, residual = layer.forward(
                hidden, residual, self.rope, cos_sin, attn, self.cpu_kernels, keep
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
        return logits

    def _fused_layers(
        self, attn: AttentionContext, rows: int
    ) -> tuple[KernelDecodeStep, torch.Tensor] | None:
        """(the step, the whole cache) where every layer can run in one
        `cpu_kernels.decode_layers` call: a decode step of at most the small-batch GEMMs'
        rows on the C++ kernels; None where the step goes layer by layer (which computes the
        same bits, one kernel call at a time)."""
        weights = self.fused_decode
        if self.cpu_kernels is None or weights is None or rows > weights.max_rows:
            return None
        return attn.kernel_decode() if isinstance(attn, KernelDecodeContext) else None

    def _run_fused_layers(
        self,
        step: KernelDecodeStep,
        cache: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: CosSin,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer 0's first norm here (the layer path's), then every layer in one call."""
        weights, kernels, cfg = self.fused_decode, self.cpu_kernels, self.config
        assert weights is not None and kernels is not None
        first: RMSNorm = self.layers[0].input_layernorm  # type: ignore[assignment]
        h, residual = first.add_forward(hidden, residual, kernels)
        out, residual = kernels.decode_layers(
            h, residual, weights.norm_in, weights.norm_post, weights.qkv, weights.o,
            weights.gate_up, weights.down, weights.biases, cache, *cos_sin,
            step.page_table, step.kv_lens, step.slots, cfg.num_heads, cfg.num_kv_heads,
            cfg.intermediate_size, step.scale, first.eps,
        )  # fmt: skip
        return out, residual
