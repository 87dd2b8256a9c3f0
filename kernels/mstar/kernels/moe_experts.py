"""Mixture-of-experts expert MLPs over a step's routed rows: the CPU grouped kernel, and
torch's grouped GEMM everywhere else (CUDA, or CPU without the C++ kernels).

A step's tokens each chose ``top_k`` experts (ids [T, k], weights [T, k]). Both paths group
the (token, choice) rows by expert, so each expert's weights are read once per step whatever
its number of rows, multiply them by the expert's gate/up weight, apply the activation, multiply
by its down weight, and sum each token's choices weighted. On CUDA nothing is read back to the
host: the rows are sorted on the device (``argsort``, ``scatter_add_``, ``cumsum``) and the
offsets handed to ``grouped_mm``, so a decode step stays capturable in a graph; the CPU kernel
sorts inside C++.

Weights: ``gate_up`` [E, 2I, H] (the gate's I rows, then the up's), ``down`` [E, H, I], biases
[E, 2I] / [E, H] or None. On CPU, `CpuExperts` packs them once into the small-batch GEMMs'
layouts (`cpu_gemm.small_batch_kernel`'s: AMX tiles, VDPBF16PS panels, or FMA panels; float32
takes FMA panels), stacked over experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
import torch.nn.functional as F


class ExpertActivation(IntEnum):
    """The activation between the two projections (the C++ kernel's ``activation``)."""

    #: SiLU(gate) * up: Qwen-MoE, Mixtral
    SILU_MUL = 0
    #: gpt-oss: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
    CLAMPED_SWIGLU = 1


@dataclass(frozen=True)
class ExpertAct:
    """An activation and gpt-oss's constants (unused by SiLU)."""

    kind: ExpertActivation = ExpertActivation.SILU_MUL
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[R, 2I] (gate | up) -> [R, I], rounded where torch's ops round."""
        inter = gate_up.shape[-1] // 2
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        if self.kind == ExpertActivation.SILU_MUL:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def grouped_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down: torch.Tensor,
    down_bias: torch.Tensor | None,
    act: ExpertAct,
    *,
    grouped_mm: bool | None = None,
) -> torch.Tensor:
    """[T, H]: the experts' MLPs of x's rows in torch, rows sorted by expert. ``grouped_mm``
    (default: on CUDA) multiplies every expert's rows in one ``F.grouped_mm`` per projection,
    with the offsets on the device: no host sync, capturable in a graph (bf16, SM80 and up).
    Otherwise each expert with rows takes one ``torch.mm`` (the counts read on the host):
    torch's CPU ``grouped_mm`` is a reference loop, 350 ms for one bf16 token of a 48-expert
    block where this takes a few."""
    if grouped_mm is None:
        grouped_mm = x.device.type == "cuda"
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)
    ends = None if grouped_mm else offsets.tolist()

    def project(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if ends is None:
            return F.grouped_mm(rows, w.transpose(1, 2), offs=offsets)
        out = rows.new_empty(rows.shape[0], w.shape[1])
        for e, (start, end) in enumerate(zip([0, *ends], ends, strict=False)):
            if end > start:
                torch.mm(rows[start:end], w[e].t(), out=out[start:end])
        return out

    h = project(x.index_select(0, order // top_k), gate_up)
    if gate_up_bias is not None:
        h += gate_up_bias.index_select(0, flat[order])
    y = project(act(h), down)
    if down_bias is not None:
        y += down_bias.index_select(0, flat[order])
    by_choice = torch.empty_like(y).index_copy_(0, order, y).view(tokens, top_k, -1)
    return (by_choice.float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def cpu_expert_pack(kernels: Any | None, dtype: torch.dtype) -> Callable[[Any], Any] | None:
    """The pack function of the GEMM the CPU kernel runs experts on for ``dtype`` at the
    kernels' level: bf16 on AMX tiles where granted, else VDPBF16PS, else FMA over widened bf16;
    float32 on FMA panels (every level: the x86-64 baseline runs their plain vector code).
    None without the kernels or for another dtype."""
    if kernels is None or dtype not in (torch.float32, torch.bfloat16):
        return None
    if dtype == torch.bfloat16 and kernels.amx_available():
        pack: Callable[[Any], Any] = kernels.amx_pack_weight
    elif dtype == torch.bfloat16 and kernels.dpbf16_available():
        pack = kernels.dpbf16_pack_weight
    else:
        pack = kernels.fma_pack_weight
    return pack


@dataclass(frozen=True)
class CpuExperts:
    """Every expert's weights packed once for the C++ grouped kernel (``moe_experts``)."""

    kernels: Any
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    inter: int
    act: ExpertAct

    @staticmethod
    def pack(
        kernels: Any,
        gate_up: torch.Tensor,
        gate_up_bias: torch.Tensor | None,
        down: torch.Tensor,
        down_bias: torch.Tensor | None,
        act: ExpertAct,
        pack: Callable[[Any], Any] | None = None,
    ) -> CpuExperts:
        """Packs [E, 2I, H] and [E, H, I] with ``pack`` (default: `cpu_expert_pack`'s; the
        kernels' pack functions take a stack of experts); ValueError where the kernels take no
        such weights."""
        pack = pack or cpu_expert_pack(kernels, gate_up.dtype)
        if pack is None:
            raise ValueError(f"the CPU MoE kernel takes float32 or bf16, not {gate_up.dtype}")

        def stack(w: torch.Tensor) -> torch.Tensor:
            return pack(w.detach())  # the kernels pack [E, N, K] expert by expert, in place

        def bias(b: torch.Tensor | None) -> torch.Tensor | None:
            return None if b is None else b.detach().contiguous()

        inter = down.shape[2]
        return CpuExperts(
            kernels, stack(gate_up), bias(gate_up_bias), stack(down), bias(down_bias), inter, act
        )

    def with_routing(
        self, top_k: int, softmax_first: bool, renormalize: bool, round_weights: bool
    ) -> Any:
        """The kernels' ``MoeLayer``: these experts behind a router's top-k, in C++ (the layer
        path and the fused decode step run the same one). ``softmax_first``: softmax over every
        expert then the top k (Qwen-MoE, Mixtral), else the top k then softmax over them
        (gpt-oss); ``renormalize``: the top-k weights divided by their sum;
        ``round_weights``: rounded to the model's dtype before use."""
        return self.kernels.MoeLayer(
            self.gate_up, self.gate_up_bias, self.down, self.down_bias, self.inter,
            int(self.act.kind), self.act.alpha, self.act.limit,
            top_k, 0 if softmax_first else 1, renormalize, round_weights,
        )  # fmt: skip

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.kernels.moe_experts(
            x if x.stride(-1) == 1 else x.contiguous(),
            ids.contiguous(),
            weights.float().contiguous(),
            self.gate_up,
            self.gate_up_bias,
            self.down,
            self.down_bias,
            self.inter,
            int(self.act.kind),
            self.act.alpha,
            self.act.limit,
        )
        return out
