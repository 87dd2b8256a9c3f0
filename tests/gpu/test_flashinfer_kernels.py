"""FlashInfer at the kernel level on CUDA (skipped without one): the stream hand-off, and a
CUDA-graph decode wrapper captured once and replayed over new plans.

``tests/gpu/first_run.sh`` runs this file first, alone: its first test triggers FlashInfer's JIT
compile of the one FA2 module every wrapper uses, and a failure here (no hand-off, no compile)
makes every later GPU test meaningless, so the script stops.

The stream hand-off: FlashInfer 0.6 launches through tvm-ffi, which takes the stream from torch's
current stream only when torch exports its DLPack C exchange API. Without it kernels go to the
default stream: a CUDA graph captured on a side stream breaks, and the engine's event ordering
(`plan_staging`) would order the wrong stream.
"""

from __future__ import annotations

import time

import torch
from cuda_testing import (
    KERNEL_SHAPE,
    cuda_decode_case,
    needs_cuda,
    needs_flashinfer,
    torch_attention,
)

from mstar.kernels import FlashInferPagedAttention

pytestmark = [needs_cuda, needs_flashinfer]

#: ~0.5 s of busy device work at the H200's ~2 GHz
SLEEP_CYCLES = 1_000_000_000


def test_flashinfer_kernels_run_on_torchs_current_stream() -> None:
    pool, q, plan = cuda_decode_case([37, 200, 5, 64], seed=0)
    fi = FlashInferPagedAttention("cuda", torch.bfloat16)
    fi.plan(*plan, **KERNEL_SHAPE)  # the first plan/run compiles the FA2 module (JIT)
    expected = fi.run(q, pool).cpu()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    torch.cuda._sleep(SLEEP_CYCLES)  # the default stream is busy for ~0.5 s
    start = time.perf_counter()
    with torch.cuda.stream(side):
        out = fi.run(q, pool)
        got = out.cpu()  # waits for the side stream only
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    print(f"side-stream run while the default stream sleeps: {elapsed * 1e3:.1f} ms")
    # On the side stream the kernel neither waits for the sleep nor is read before it ran.
    assert torch.equal(got, expected), "FlashInfer's kernel did not run on torch's stream"
    assert elapsed < 0.2, f"FlashInfer's kernel waited for the default stream ({elapsed:.2f} s)"


def test_captured_graph_decode_replays_each_new_plan() -> None:
    bs = 4
    fi = FlashInferPagedAttention("cuda", torch.bfloat16)
    graph_decode = fi.graph_decode(bs, max_pages=128)
    # The captured run reads this pool; later layouts address pages of it (ids below 70).
    pool, q0, plan0 = cuda_decode_case([600, 512, 300, 250], seed=1)
    q_static = q0.clone()
    graph_decode.plan(*plan0, **KERNEL_SHAPE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        graph_decode.run(q_static, pool)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = graph_decode.run(q_static, pool)
    layouts = [[37, 200, 5, 64], [1, 512, 17, 300], [16, 16, 33, 129], [600, 2, 90, 250]]
    later = [cuda_decode_case(lens, seed=s)[1:] for s, lens in enumerate(layouts, 2)]
    cases = [(q0, plan0), *later]
    for q, plan in cases:
        graph_decode.plan(*plan, **KERNEL_SHAPE)  # rewrites the fixed buffers the graph reads
        q_static.copy_(q)
        graph.replay()
        replayed = out_static.clone()
        fi.plan(*plan, **KERNEL_SHAPE)
        eager = fi.run(q, pool)
        reference = torch_attention(pool, q, plan)
        torch.testing.assert_close(replayed.float(), reference.float(), atol=2e-2, rtol=2e-2)
        # Graph plans always split KV and merge; eager ones may not: one bf16 rounding apart.
        torch.testing.assert_close(replayed.float(), eager.float(), atol=1e-2, rtol=1e-2)
    assert graph_decode.staging.waits == len(cases)  # every re-plan waited for the last one
    assert fi.workspace_bytes > 0 and graph_decode.plans == len(cases) + 1
