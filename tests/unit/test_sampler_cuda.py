"""The sampler on CUDA agrees with the CPU one; `python3 <this file>` times a step.

Skipped without CUDA. Seeded and greedy rows must give the same tokens on both devices (their
noise is a pure function of seed, output index and vocab id); unseeded rows use each device's
own generator and are only checked for validity.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import pytest
import torch

from mstar.engine.resources.sampling import SamplerRequestConfig, SamplerResource
from mstar.engine.resources.step import ResourceStep, Segment, StepContext
from mstar.engine.sampling_params import SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MIX: list[SamplingParams] = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, logprobs=5),
    SamplingParams(seed=7, top_p=0.9, top_k=50),
    SamplingParams(seed=8, temperature=0.7, min_p=0.05, presence_penalty=0.5),
    SamplingParams(seed=9, temperature=1.3, repetition_penalty=1.1, logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.95),  # unseeded
]


def build(device: str, vocab: int, params: list[SamplingParams]) -> SamplerResource:
    res = SamplerResource(vocab, device=device, seed=0, initial_capacity=len(params) + 1)
    for i, p in enumerate(params):
        res.ingest_request(f"r{i}", SamplerRequestConfig(p, list(range(0, 64, 3))))
    return res


def layout(n: int) -> tuple[ResourceStep, StepContext]:
    rids = [f"r{i}" for i in range(n)]
    step = ResourceStep(segments=tuple(Segment(r, "main", 1) for r in rids))
    return step, StepContext(request_ids=rids, graph_walk="decode", slot=0, capture=False)


@needs_cuda
def test_cuda_agrees_with_cpu() -> None:
    vocab = 4096
    cpu, gpu = build("cpu", vocab, MIX), build("cuda", vocab, MIX)
    step, ctx = layout(len(MIX))
    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        logits = torch.randn(len(MIX), vocab, generator=g) * 3
        outs = []
        for res, lg in ((cpu, logits), (gpu, logits.cuda())):
            outs.append(res.sample(res.plan(step, ctx), lg))
            res.commit(step, ctx)
        a, b = outs
        assert a.token_ids[:5] == b.token_ids[:5]
        assert 0 <= b.token_ids[5] < vocab
        assert a.logprobs is not None and b.logprobs is not None
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            if la is None or lb is None:
                assert la is lb
                continue
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]


@needs_cuda
def test_cuda_seeded_distribution() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    res = build("cuda", 4, [SamplingParams(seed=s) for s in range(20000)])
    step, ctx = layout(20000)
    logits = torch.tensor(probs, device="cuda").log().expand(20000, 4).contiguous()
    toks = res.sample(res.plan(step, ctx), logits).token_ids
    counts = [toks.count(t) for t in range(4)]
    chi2 = sum((c - 20000 * p) ** 2 / (20000 * p) for c, p in zip(counts, probs, strict=True))
    assert chi2 < 16.27, counts


@needs_cuda
def test_host_calls_do_not_wait_for_the_device() -> None:
    """Admission, planning, commit and release queue their copies behind the device's work.

    The engine plans step n+1 while step n's forward runs: a synchronous copy in any of these
    would make the host wait out that forward every step (on the H200 the sampler's index
    tensors did). Each call runs behind ~100 ms of queued device work, and that work must still
    be running when the call returns.
    """
    vocab = 4096
    res = build("cuda", vocab, MIX)
    step, ctx = layout(len(MIX))
    logits = torch.randn(len(MIX), vocab, device="cuda")

    def returns_before_the_device(name: str, call: Callable[[], object]) -> None:
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        queued = torch.cuda.Event()
        queued.record()
        call()
        assert not queued.query(), f"{name} waited for the device"

    late = SamplingParams(seed=3, min_tokens=2, logit_bias={5: 1.0}, repetition_penalty=1.2)
    returns_before_the_device(
        "ingest_request", lambda: res.ingest_request("late", SamplerRequestConfig(late, [1, 2]))
    )
    returns_before_the_device("remove_request", lambda: res.remove_request("late"))
    plans = []
    returns_before_the_device("plan", lambda: plans.append(res.plan(step, ctx)))
    res.sample(plans[0], logits)  # reads the tokens back: this one waits, by design
    returns_before_the_device("commit", lambda: res.commit(step, ctx))
    torch.cuda.synchronize()


def bench(device: str, vocab: int, batch_sizes: list[int], iters: int) -> None:
    """Print mean plan+sample+commit time per step for a few feature mixes."""
    modes = {
        "greedy": SamplingParams(temperature=0.0),
        "temp": SamplingParams(temperature=0.8),
        "top_k+top_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
        "seeded+top_p": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5),
    }
    print(f"device={device} vocab={vocab} (ms per step: plan + sample + commit)")
    print("mode".ljust(14) + "".join(f"bs={bs}".rjust(10) for bs in batch_sizes))
    for name, p in modes.items():
        row = name.ljust(14)
        for bs in batch_sizes:
            res = build(device, vocab, [p] * bs)
            step, ctx = layout(bs)
            logits = torch.randn(bs, vocab, device=device)
            for i in range(iters + 3):
                if i == 3:
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                res.sample(res.plan(step, ctx), logits)  # .tolist() inside synchronises
                res.commit(step, ctx)
            if device == "cuda":
                torch.cuda.synchronize()
            row += f"{(time.perf_counter() - t0) / iters * 1e3:10.3f}"
        print(row)


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 128256
    sizes = [int(s) for s in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1, 16, 64, 256]
    bench(dev, vocab, sizes, iters=int(sys.argv[4]) if len(sys.argv) > 4 else 20)
