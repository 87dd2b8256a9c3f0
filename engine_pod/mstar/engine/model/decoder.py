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

import functools
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mstar.engine.model.config import ModelConfig
from mstar.engine.model.rope import RotaryEmbedding
from mstar.kernels import cpu_kernels


class AttentionContext(Protocol):
    """Per-step attention over the paged KV cache (the engine implements it)."""

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Write k/v [T, Hkv, D] for ``layer_idx`` into the cache, return attention [T, Hq, D]."""
        ...


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


#: float32 batches below this many rows keep MKL's ``F.linear`` on Intel CPUs: measured on a
#: 2-core AVX-512 Xeon over SmolLM2's four projections, oneDNN's packed float32 kernel is 1.45x
#: slower at 1-2 rows and 1.35x / 1.27x / 1.14x faster at 8 / 32 / 64 (the LM head: 2.0x faster
#: at 8). Elsewhere MKL's sgemm is slow at few rows: on a 2-core AMD EPYC (Zen 4) the packed
#: kernel was 1.5x / 2.8x / 3.2x faster at 1 / 2 / 4 rows, so every batch takes it.
INTEL_FLOAT32_PACKED_MIN_ROWS = 8


@functools.cache
def float32_packed_min_rows() -> int:
    """Rows from which float32 linears take oneDNN's packed kernel (see the constant above)."""
    try:
        with open("/proc/cpuinfo") as f:
            intel = any(ln.startswith("vendor_id") and "GenuineIntel" in ln for ln in f)
    except OSError:
        intel = True  # unknown: keep both kernels, the choice measured first
    return INTEL_FLOAT32_PACKED_MIN_ROWS if intel else 0


#: Where the CPU has no bf16 math, bf16 batches from this many rows multiply float32 copies of
#: their weights. oneDNN emulates bf16 GEMMs there: on a 2-core AVX-512 Xeon without
#: AVX512-BF16, SmolLM2's linears ran 1.4x / 3.6x / 4.3x slower than float32 at 2 / 32 / 64
#: rows. One row stays on the bf16 weight: it reads half the bytes, and in the engine a
#: one-sequence decode step took 30 ms that way against 40 ms on float32 weights.
BF16_FLOAT32_GEMM_MIN_ROWS = 2


#: bf16 batches up to this many rows run `cpu_kernels.amx_linear` where the CPU has AMX tiles
#: (a decode step's shapes: weights stream from DRAM once for a few dozen rows). Measured on a
#: 2-core Xeon with AMX over SmolLM2's linears, weights cold: a step's 121 linears took
#: 12.9 / 13.4 / 19.7 / 31.8 / 55.0 ms against oneDNN's 20.4 / 23.8 / 28.0 / 37.9 / 59.7 at
#: 1 / 32 / 64 / 128 / 256 rows, but from 128 rows up the LM head alone was slower (8.1 vs
#: 7.0 ms at 128, 15.7 vs 10.3 at 256), and prompt chunks are oneDNN's ground.
AMX_MAX_ROWS = 128

#: Where the CPU has AVX512-BF16 but no AMX, bf16 batches up to this many rows run
#: `cpu_kernels.dpbf16_linear`. Measured on a 2-core Zen 5 over SmolLM2's 120 projections,
#: weights cold: 5.6 / 5.0 / 9.6 / 18.2 / 34.0 ms against oneDNN's 8.7 / 8.1 / 14.0 / 23.4 /
#: 38.4 at 1 / 8 / 32 / 64 / 128 rows; at 256 rows oneDNN's kernel was ahead (gate/up: 1.06 vs
#: 1.27 ms), and prompt chunks are its ground.
DPBF16_MAX_ROWS = 128


def small_batch_kernel(kernels: Any | None) -> tuple[Any, Any, int] | None:
    """(linear, pack_weight, max rows) of the bf16 GEMM for decode-sized batches on this CPU:
    AMX tiles where it has them, else VDPBF16PS, else None (oneDNN's kernel for every batch)."""
    if kernels is None:
        return None
    if kernels.amx_available():
        return kernels.amx_linear, kernels.amx_pack_weight, AMX_MAX_ROWS
    if kernels.dpbf16_available():
        return kernels.dpbf16_linear, kernels.dpbf16_pack_weight, DPBF16_MAX_ROWS
    return None


def cpu_has_bf16() -> bool:
    """Native bf16 math (AVX512-BF16 or AMX); without it oneDNN emulates bf16 GEMMs."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def _onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


class PackedLinear(nn.Module):
    """A CPU linear whose weight oneDNN reorders once, at load, into its blocked layout.

    ``F.linear`` re-lays a bf16 weight out on every call; that made SmolLM2's bf16 linears 1.6x
    slower at one token and 2.2x at 32 (micro-benchmark on a 2-core AVX-512 Xeon). In float32,
    on Intel, oneDNN wins only from `float32_packed_min_rows` rows up, so a float32 layer there
    keeps its plain weight too and small batches use it. Packed results are rounded differently from
    ``F.linear``'s (not bit-identical); the exactness tests against transformers cover both.

    ``float32_gemm`` (bf16 weights on a CPU without bf16 math, see `BF16_FLOAT32_GEMM_MIN_ROWS`):
    batches from that many rows run a float32 GEMM on exact float32 copies of the bf16 weight
    and input, rounding the output to bf16. That is a bf16 GEMM with float32 accumulation, what
    oneDNN's emulation computes, at float32 speed; it costs a float32 copy of every weight.

    ``kernels`` (`cpu_kernels.load()`'s extension): where `small_batch_kernel` finds one (AMX
    tiles or AVX512-BF16), a bf16 layer also keeps its weight in that kernel's layout
    (``small_batch_weight``), and batches up to its row limit run it (the same float32
    accumulation rounded once).
    """

    packed_weight: torch.Tensor
    small_batch_weight: torch.Tensor | None

    def __init__(
        self, linear: nn.Linear, *, float32_gemm: bool = False, kernels: Any | None = None
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.bias = linear.bias
        self.min_rows = 0
        self.weight: torch.Tensor | None = None
        self.few_rows_weight: torch.Tensor | None = None
        self.float32_bias: torch.Tensor | None = None
        if weight.dtype == torch.float32 and float32_packed_min_rows() > 1:
            self.min_rows = float32_packed_min_rows()
            self.weight = linear.weight
        elif float32_gemm and weight.dtype == torch.bfloat16:
            self.min_rows = BF16_FLOAT32_GEMM_MIN_ROWS
            self.few_rows_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            if linear.bias is not None:
                self.float32_bias = linear.bias.detach().float()
            weight = weight.float()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.small_batch_linear: Any | None = None
        self.small_batch_max_rows = 0
        small = None
        kernel = small_batch_kernel(kernels) if weight.dtype == torch.bfloat16 else None
        if kernel is not None:
            self.small_batch_linear, pack, self.small_batch_max_rows = kernel
            small = pack(weight)
        self.register_buffer("small_batch_weight", small, persistent=False)

    @property
    def upcast(self) -> bool:
        """True when batches from `min_rows` up run the float32 GEMM of ``float32_gemm``."""
        return self.few_rows_weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small_batch_weight is not None and x.shape[0] <= self.small_batch_max_rows:
            assert self.small_batch_linear is not None
            out: torch.Tensor = self.small_batch_linear(
                x, self.small_batch_weight, self.out_features, self.bias
            )
            return out
        if x.shape[0] < self.min_rows:
            if self.weight is not None:
                return F.linear(x, self.weight, self.bias)
            assert self.few_rows_weight is not None
            return _onednn_linear(x, self.few_rows_weight, self.bias)
        if self.few_rows_weight is not None:
            out = _onednn_linear(x.float(), self.packed_weight, self.float32_bias)
            return out.to(x.dtype)
        return _onednn_linear(x, self.packed_weight, self.bias)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packing pays for bf16 and (from a few rows up) float32 on CPU."""
    return (
        device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float32)
        and torch.backends.mkldnn.is_available()
    )


def pack_linears_(
    decoder: Decoder, *, float32_gemm: bool = False, kernels: Any | None = None
) -> None:
    """Swap every projection and the LM head for a `PackedLinear` (see `can_pack`)."""
    for layer in decoder.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            linear = getattr(layer, name)
            if isinstance(linear, nn.Linear):
                packed = PackedLinear(linear, float32_gemm=float32_gemm, kernels=kernels)
                setattr(layer, name, packed)
    if isinstance(decoder.lm_head, nn.Linear):
        decoder.lm_head = PackedLinear(decoder.lm_head, float32_gemm=float32_gemm, kernels=kernels)


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
        last = len(self.layers) - 1
        # Only the sampled rows' last-layer output reaches the LM head: the rest of a prompt
        # chunk stops after the last attention (its K/V are all later steps need). That skips
        # o_proj and the MLP of one layer for nearly every prompt token (~2.8% of SmolLM2's
        # prefill FLOPs). Row-wise ops: the sampled rows' numbers do not change, except by
        # rounding where a GEMM picks its kernel by row count (`float32_packed_min_rows`,
        # `small_batch_kernel`).
        prune = last > 0 and logits_indices.shape[0] < input_ids.shape[0]
        for i, layer in enumerate(self.layers):
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
