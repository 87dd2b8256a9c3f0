"""MoE experts on CUDA, capturable in the decode graph (issue 45).

The router already runs on the device with no host read (`moe.route`: ``torch.topk``). The
experts take one of three forms, none reading a count back to the host while a graph records:

- bf16 on SM80 and up: torch's grouped GEMM (`grouped_experts` with ``grouped_mm``), the rows
  sorted by expert on the device, each expert's weights read once;
- any other dtype or GPU (``F.grouped_mm`` takes bf16 on SM80+ only: an fp16 engine, or a GPU
  before Ampere; graphs need FlashInfer, so never float32) while a graph is being captured: a
  fixed-shape form chosen by the bucket's rows, `gathered_experts` when its ``T*k`` (token,
  choice) rows are at most the expert count (each row's expert weights ``index_select``-ed
  into [T*k, ...] and one ``bmm`` per projection: reads no more than the experts chosen), else
  `dense_experts` (every expert over every row, weighed by a [T, E] routing matrix that is zero
  off the top-k: each expert's weights read once, ``E/k`` times the flops);
- any other dtype eagerly (float32 included): the per-expert loop (`grouped_experts` without
  ``grouped_mm``), whose host-side counts cost nothing outside a graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.kernels.moe_experts import ExpertAct, grouped_experts


@dataclass(frozen=True)
class Experts:
    """One block's stacked expert weights (`moe_experts`' layout) and activation."""

    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    act: ExpertAct


def grouped_mm_runs(x: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes ``x``'s rows: bf16 on a CUDA device of SM80+."""
    return (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (8, 0)
    )


def gathered_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, e: Experts
) -> torch.Tensor:
    """[T, H]: each (token, choice) row through its expert's weights gathered into [T*k, ...],
    one ``bmm`` per projection; fixed shapes, no host read."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    rows = x.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
    h = torch.bmm(e.gate_up.index_select(0, flat), rows).squeeze(-1)  # [T*k, 2I]
    if e.gate_up_bias is not None:
        h = h + e.gate_up_bias.index_select(0, flat)
    y = torch.bmm(e.down.index_select(0, flat), e.act(h).unsqueeze(-1)).squeeze(-1)  # [T*k, H]
    if e.down_bias is not None:
        y = y + e.down_bias.index_select(0, flat)
    return (y.view(tokens, top_k, -1).float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def dense_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, e: Experts
) -> torch.Tensor:
    """[T, H]: every expert over every row, summed with the routing weights (zero off each
    row's top-k); fixed shapes, no host read."""
    tokens = x.shape[0]
    experts = e.gate_up.shape[0]
    routing = torch.zeros(tokens, experts, dtype=torch.float32, device=x.device)
    routing.scatter_(1, ids, weights.float())
    h = torch.matmul(x.unsqueeze(0), e.gate_up.transpose(1, 2))  # [E, T, 2I]
    if e.gate_up_bias is not None:
        h = h + e.gate_up_bias.unsqueeze(1)
    a = e.act(h.reshape(experts * tokens, -1)).view(experts, tokens, -1)
    y = torch.bmm(a, e.down.transpose(1, 2))  # [E, T, H]
    if e.down_bias is not None:
        y = y + e.down_bias.unsqueeze(1)
    return (y.float() * routing.t().unsqueeze(-1)).sum(0).to(x.dtype)


def fixed_shape_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, e: Experts
) -> torch.Tensor:
    """`gathered_experts` when the step's (token, choice) rows are at most the experts, else
    `dense_experts`: the fixed-shape form that reads the fewest weights."""
    form = gathered_experts if ids.numel() <= e.gate_up.shape[0] else dense_experts
    return form(x, ids, weights, e)


def cuda_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, e: Experts
) -> torch.Tensor:
    """The experts of x's rows on CUDA, in the form the module docstring picks."""
    if not grouped_mm_runs(x) and torch.cuda.is_current_stream_capturing():
        return fixed_shape_experts(x, ids, weights, e)
    return grouped_experts(
        x, ids, weights, e.gate_up, e.gate_up_bias, e.down, e.down_bias, e.act,
        grouped_mm=grouped_mm_runs(x),
    )  # fmt: skip
