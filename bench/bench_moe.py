"""One MoE block on CPU: the grouped C++ kernel against a naive per-expert torch loop.

The shape is Qwen3-MoE's family at a size this machine holds: hidden 1,024, 48 experts of
width 384, top-8 of them per token, softmax routing renormalised (``norm_topk_prob``), random
weights (113 MB of experts in bf16, more than any L3 here, so a step streams them from DRAM).
Per token count it times, in ms per call of the whole block (router included):

- ``grouped kernel``: `MoeBlock` on `cpu_kernels.moe_experts` (this CPU's level);
- ``torch fallback``: `MoeBlock` without the kernels (rows sorted by expert, one ``torch.mm``
  per expert with rows; CUDA's ``F.grouped_mm`` is a reference loop on CPU);
- ``naive loop``: the router, then one step per expert that has tokens (``torch.where``,
  two ``F.linear``, ``index_add_``), as transformers' eager experts run.

Each figure is the best of ``--repeat`` means over ``--calls`` calls. All three give the same
outputs to rounding (checked before timing).

    python3 bench/bench_moe.py [--tokens 1 8 32] [--dtypes bfloat16 float32] [--repeat 3]
                               [--calls 10] [--threads N]
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
import torch.nn.functional as F

from mstar.engine.model.moe import MoeBlock, MoeSpec, route
from mstar.kernels import cpu_kernels

CONFIG = {
    "model_type": "qwen3_moe",
    "hidden_size": 1024,
    "moe_intermediate_size": 384,
    "num_experts": 48,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
}


def naive_loop(block: MoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The experts one by one in Python over the block's plain weights."""
    weights, ids = route(block.router(x), block.spec)
    inter = block.spec.inter
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        token, choice = torch.where(ids == e)
        h = F.linear(x[token], block.gate_up[e])
        y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], block.down[e])
        out.index_add_(0, token, (y * weights[token, choice, None]).to(x.dtype))
    return out


def best_ms(fn, x: torch.Tensor, calls: int, repeat: int) -> float:
    fn(x)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        best = min(best, (time.perf_counter() - start) / calls * 1000)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels.load()
    assert kernels is not None, "the CPU kernels did not build"
    spec = MoeSpec.from_config(CONFIG)
    print(f"level {kernels.isa_level()}, {torch.get_num_threads()} threads, "
          f"loadavg {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"shape: hidden {spec.hidden}, {spec.num_experts} experts of width {spec.inter}, "
          f"top-{spec.top_k}")  # fmt: skip
    print("| dtype | tokens | grouped kernel ms | torch fallback ms | naive loop ms | "
          "naive / kernel |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        plain = MoeBlock(spec, dtype)
        with torch.no_grad():
            for param in plain.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.03)
        packed = MoeBlock(spec, dtype)
        packed.load_state_dict(plain.state_dict())
        packed.use_cpu_kernels(kernels)
        for tokens in args.tokens:
            x = torch.randn(tokens, spec.hidden, generator=gen).to(dtype)
            ref = naive_loop(plain, x).float()
            for out in (packed(x), plain(x)):
                torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
            times = [
                best_ms(fn, x, args.calls, args.repeat)
                for fn in (packed, plain, functools.partial(naive_loop, plain))
            ]
            print(f"| {name} | {tokens} | {times[0]:.2f} | {times[1]:.2f} | {times[2]:.2f} | "
                  f"{times[2] / times[0]:.1f}x |")  # fmt: skip
    print(f"loadavg after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
