"""vLLM-CPU side of `bench_lora.py`: run inside vLLM's own virtual environment.

    python vllm_lora.py WORK.json RESULT.json

WORK.json: {"model", "rank", "new_tokens", "adapters": {name: folder}, "batches": [[prompt
token ids, ...] per repeat]}. Per repeat: the batch on the base, then request i on adapter
i % 8 (``enable_lora``, ``max_loras`` = the adapter count, each adapter warmed first). Greedy,
``ignore_eos``. RESULT.json: {"base": [tok/s...], "8 adapters": [tok/s...]}. Imports nothing
of mstar.
"""

from __future__ import annotations

import json
import sys

from vllm_offline import timed_generate


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    with open(sys.argv[1]) as f:
        work = json.load(f)
    adapters = [LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(work["adapters"].items())]
    llm = LLM(
        model=work["model"], dtype="bfloat16", max_num_seqs=len(work["batches"][0]),
        enable_prefix_caching=False, seed=0, enable_lora=True, max_loras=len(adapters),
        max_lora_rank=work["rank"],
    )  # fmt: skip
    new = work["new_tokens"]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    warm = [TokensPrompt(prompt_token_ids=[100, 200, 300])] * len(adapters)
    llm.generate(warm, params, lora_request=adapters, use_tqdm=False)
    result: dict[str, list[float]] = {"base": [], "8 adapters": []}
    for prompts in work["batches"]:
        mixed = [adapters[i % len(adapters)] for i in range(len(prompts))]
        result["base"].append(timed_generate(llm, prompts, params, new))
        result["8 adapters"].append(timed_generate(llm, prompts, params, new, lora_request=mixed))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
