"""The layers every family shares: RMSNorm (plain, and Gemma's ``1 + w``) and the decoder
block (attention with optional q/k norm, a per-layer RoPE table and sliding window, then a
gated MLP), each configured by `ModelConfig` and built through the linear seam.

The math mirrors transformers (HF RMSNorm with float32 upcast, rotate_half RoPE), so float32
greedy decoding is token-identical. Q/K/V and gate/up are one fused projection each.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mstar.engine.model.config import ModelConfig
from mstar.engine.model.linear import Linears, LinearSpec
from mstar.engine.model.moe import MoeBlock
from mstar.engine.model.rope import RotaryEmbedding
from mstar.kernels import cpu_kernels


class AttentionContext(Protocol):
    """Per-step attention over the paged KV cache (the engine implements it)."""

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write k/v [T, Hkv, D] for ``layer_idx`` into the cache, return attention [T, Hq, D]
        (with that layer's sliding window and the model's softmax scale; ``sinks``: float32
        [Hq] attention-sink logits, passed only by layers that have them)."""
        ...


class RMSNorm(nn.Module):
    """HF RMSNorm: normalise in float32, cast back, then scale in the input dtype.

    ``offset`` (Gemma): the checkpoint's ``w`` scales by ``1 + w`` in float32 before the cast;
    the parameter holds ``1 + w`` in float32 (`load_`), so float32 runs the same fused pass.
    """

    def __init__(
        self,
        size: int,
        eps: float,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        offset: bool = False,
    ) -> None:
        super().__init__()
        self.offset = offset
        wdtype = torch.float32 if offset else dtype
        self.weight = nn.Parameter(torch.ones(size, dtype=wdtype, device=device))
        self.eps = eps

    def load_(self, tensor: torch.Tensor) -> None:
        """Copy the checkpoint's weight (Gemma's ``w`` becomes ``1 + w``, in float32)."""
        if tensor.shape != self.weight.shape:
            raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(self.weight.shape)}")
        self.weight.copy_(1.0 + tensor.float() if self.offset else tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused pass; bit-identical to the three-step form below in float32 (checked
            # against transformers by the exactness tests), ~6 elementwise passes fewer.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        if self.offset:
            return (h * self.weight).to(x.dtype)
        return self.weight * h.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, kernels: Any | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); with no residual yet, x is the residual.

        Overwrites ``x`` (a sublayer's fresh output), and ``residual`` on the kernel path, where
        `cpu_kernels.add_rms_norm_` does the add and the norm in one pass over the rows
        (float32 or bf16, weight in the same dtype).
        """
        if residual is None:
            return self(x), x
        if kernels is not None and self.kernel_takes(x, kernels):
            kernels.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = x.add_(residual)
        return self(residual), residual

    def kernel_takes(self, x: torch.Tensor, kernels: Any | None) -> bool:
        """True where `cpu_kernels`' norms run on x: its dtype, the weight in it or (Gemma's
        ``1 + w``) float32 on bf16, as `decode_layers` runs them."""
        if kernels is None or x.dtype not in cpu_kernels.DTYPES:
            return False
        return self.weight.dtype == x.dtype or (self.offset and x.dtype == torch.bfloat16)

    def norm_(self, x: torch.Tensor, kernels: Any | None) -> torch.Tensor:
        """x normed in place over its last dim (rows [T, D], or heads [T, H, D] with heads
        contiguous: q/k norm); returns x."""
        if kernels is not None and self.kernel_takes(x, kernels):
            kernels.rms_norm_(x, self.weight, self.eps)
            return x
        return x.copy_(self(x))


#: a step's (cos, sin) per RoPE table, gathered once for every layer that uses it
CosSin = tuple[torch.Tensor, torch.Tensor]

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class DecoderLayer(nn.Module):
    """One pre-norm transformer block with fused QKV and fused gate/up projections; q/k norm,
    Gemma's sandwich norms, the activation, RoPE table and window as the config says; in the
    config's `moe_layers`, an `MoeBlock` (``moe``) in place of the dense MLP."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        linears: Linears,
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
        self.gelu = cfg.hidden_act == "gelu_tanh"
        hidden, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset

        def norm(size: int) -> RMSNorm:
            return RMSNorm(size, eps, dtype, device, offset=off)

        self.input_layernorm = norm(hidden)
        self.post_attention_layernorm = norm(hidden)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(hidden)
            self.post_feedforward_layernorm = norm(hidden)
        #: gpt-oss: per query head, a logit in the softmax's denominator (float32 whatever the
        #: model dtype: the attention kernels take it so, beside their float32 scores)
        self.sinks: nn.Parameter | None = None
        if cfg.attn_sinks:
            self.sinks = nn.Parameter(
                torch.zeros(cfg.num_heads, dtype=torch.float32, device=device),
                requires_grad=False,
            )
        self.q_norm: RMSNorm | None = norm(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm: RMSNorm | None = norm(cfg.head_dim) if cfg.qk_norm else None
        dev = torch.device(device)
        pre = f"layers.{layer_idx}."
        kv = self.kv_size
        specs: tuple[LinearSpec, ...] = (
            LinearSpec(pre + "qkv_proj", hidden, self.q_size + 2 * kv, cfg.qkv_bias,
                       parts=(self.q_size, kv, kv)),
            LinearSpec(pre + "o_proj", self.q_size, hidden, cfg.o_bias, parallel="row"),
            LinearSpec(pre + "gate_up_proj", hidden, 2 * self.inter, cfg.mlp_bias,
                       parts=(self.inter, self.inter)),
            LinearSpec(pre + "down_proj", self.inter, hidden, cfg.mlp_bias, parallel="row"),
        )  # fmt: skip
        self.moe: MoeBlock | None = None
        if layer_idx in cfg.moe_layers:
            assert cfg.moe is not None
            self.moe = MoeBlock(cfg.moe, dtype, device)
            specs = specs[:2]  # the experts replace the dense MLP's projections
        modules = [linears.create(spec, dtype, dev) for spec in specs]
        self.qkv_proj, self.o_proj = modules[:2]
        if self.moe is None:
            self.gate_up_proj, self.down_proj = modules[2:]

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryEmbedding,
        cos_sin: CosSin,
        attn: AttentionContext,
        kernels: Any | None = None,
        keep_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual): the residual add is left to the next norm, which fuses it.

        ``hidden`` is the previous layer's MLP output (the embeddings, with ``residual`` None,
        for layer 0); ``rope`` / ``cos_sin`` are this layer's RoPE table and its rows at the
        step's positions; ``kernels`` is `cpu_kernels.load()`'s extension or None (torch ops).
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
        if self.q_norm is not None and self.k_norm is not None:
            hq = self.num_heads
            self.q_norm.norm_(qk[:, :hq], kernels)
            self.k_norm.norm_(qk[:, hq:], kernels)
        rope.rotate_(qk, *cos_sin, kernels=kernels)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.sinks is None:
            o = attn.attend(self.layer_idx, q, k, v)
        else:
            o = attn.attend(self.layer_idx, q, k, v, sinks=self.sinks)
        o = o.reshape(t, self.q_size)
        if keep_rows is not None:
            assert residual is not None  # not the first layer
            o, residual = o[keep_rows], residual[keep_rows]
        h = self.o_proj.forward(o)
        if self.sandwich:
            h = self.post_attention_layernorm.norm_(h, kernels)
            x, residual = self.pre_feedforward_layernorm.add_forward(h, residual, kernels)
        else:
            x, residual = self.post_attention_layernorm.add_forward(h, residual, kernels)
        if self.moe is not None:
            out = self.moe.forward(x)
        else:
            out = self.down_proj.forward(self._act(self.gate_up_proj.forward(x), kernels))
        if self.sandwich:
            out = self.post_feedforward_layernorm.norm_(out, kernels)
        return out, residual

    @property
    def mlp_norm(self) -> RMSNorm:
        """The norm fused with the residual add before the MLP (Gemma: pre-feed-forward)."""
        return self._norm(
            "pre_feedforward_layernorm" if self.sandwich else "post_attention_layernorm"
        )

    def layout_norms(self) -> list[torch.Tensor | None]:
        """The q, k, post-attention and post-feed-forward norm weights (None where absent), in
        the order `cpu_kernels.decode_layers`' layout takes them."""
        norms: list[RMSNorm | None] = [self.q_norm, self.k_norm, None, None]
        if self.sandwich:
            norms[2:] = [
                self._norm("post_attention_layernorm"),
                self._norm("post_feedforward_layernorm"),
            ]
        return [None if n is None else n.weight.detach() for n in norms]

    def _norm(self, name: str) -> RMSNorm:
        norm = getattr(self, name)
        assert isinstance(norm, RMSNorm)
        return norm

    def _act(self, gate_up: torch.Tensor, kernels: Any | None) -> torch.Tensor:
        """act(gate) * up of the fused gate/up rows."""
        if kernels is not None and gate_up.dtype in cpu_kernels.DTYPES:
            act = kernels.gelu_tanh_mul if self.gelu else kernels.silu_mul
            out: torch.Tensor = act(gate_up)
            return out
        gate, up = gate_up[:, : self.inter], gate_up[:, self.inter :]
        # In place on fresh temporaries: two fewer allocations of [T, inter] per layer.
        if self.gelu:
            return F.gelu(gate, approximate="tanh").mul_(up)
        return F.silu(gate).mul_(up)
