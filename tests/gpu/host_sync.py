"""Which host calls on the CUDA path block until the device catches up: a table.

Each call is timed on the host right after ~50 ms of busy device work was queued
(``torch.cuda._sleep``): a call that returns in microseconds leaves the host free to run ahead
(and so needs `plan_staging`'s wait before its buffers are rewritten); one that takes ~50 ms
waited for the device, which both closes that race and stalls the host every step. Run by
``tests/gpu/first_run.sh``.

    python tests/gpu/host_sync.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from cuda_testing import KERNEL_SHAPE, cuda_decode_case

from mstar.engine.resources.sampling import SamplerRequestConfig, SamplerResource
from mstar.engine.resources.step import ResourceStep, Segment, StepContext
from mstar.engine.sampling_params import SamplingParams
from mstar.kernels import FlashInferPagedAttention

#: ~50 ms of device work at the H200's ~2 GHz
LAG_CYCLES = 100_000_000


def _blocked_ms(call: Callable[[], object]) -> float:
    call()  # warm: first-use allocations and compiles are not what is measured
    torch.cuda.synchronize()
    torch.cuda._sleep(LAG_CYCLES)
    start = time.perf_counter()
    call()
    blocked = time.perf_counter() - start
    torch.cuda.synchronize()
    return blocked * 1e3


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    pageable = torch.arange(4096, dtype=torch.int64)
    pinned = pageable.pin_memory()
    fi = FlashInferPagedAttention("cuda", torch.bfloat16)
    _, _, decode = cuda_decode_case([37, 200, 5, 64], seed=0)
    i32 = torch.int32
    prefill = (  # one sequence: 32 new tokens after 68 cached ones, 16-token pages
        torch.tensor([0, 32], dtype=i32),
        torch.tensor([0, 7], dtype=i32),
        torch.arange(7, dtype=i32),
        torch.tensor([4], dtype=i32),
    )
    graph = fi.graph_decode(4, 128)
    sampler = SamplerResource(4096, device="cuda", seed=0)
    params = SamplingParams(seed=1, top_p=0.9, repetition_penalty=1.1, logprobs=2)
    rids = [f"r{i}" for i in range(8)]
    for rid in rids:
        sampler.ingest_request(rid, SamplerRequestConfig(params, [1, 2, 3]))
    step = ResourceStep(segments=tuple(Segment(r, "main", 1) for r in rids))
    ctx = StepContext(request_ids=rids, graph_walk="decode", slot=0, capture=False)

    def churn() -> None:  # a request joins and leaves, as at admission and release
        sampler.ingest_request("x", SamplerRequestConfig(params, [4, 5]))
        sampler.remove_request("x")

    calls = {
        "pageable int64 H2D copy, non_blocking": lambda: pageable.to("cuda", non_blocking=True),
        "pinned int64 H2D copy, non_blocking": lambda: pinned.to("cuda", non_blocking=True),
        "eager decode plan": lambda: fi.plan(*decode, **KERNEL_SHAPE),
        "eager prefill plan": lambda: fi.plan(*prefill, **KERNEL_SHAPE),
        "graph decode plan": lambda: graph.plan(*decode, **KERNEL_SHAPE),
        "sampler plan, 8 seeded top-p rows with penalties": lambda: sampler.plan(step, ctx),
        "sampler request in and out": churn,
    }
    gpu = torch.cuda.get_device_name()
    print(f"host time of each call behind ~50 ms of queued device work, {gpu}")
    print("| call | host blocked ms |\n|---|---:|")
    for name, call in calls.items():
        print(f"| {name} | {_blocked_ms(call):.2f} |")


if __name__ == "__main__":
    main()
