"""transformers side of `bench_all.py --offline`: run inside its own virtual environment.

    python transformers_offline.py WORKLOAD.json RESULT.json

Same WORKLOAD/RESULT format as `vllm_offline.py`. Each repeat is one left-padded batch through
``model.generate`` (greedy, exactly ``new_tokens`` new tokens: min = max). Imports nothing of
mstar.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    import torch
    import transformers

    with open(sys.argv[1]) as f:
        work = json.load(f)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        work["model"], dtype=getattr(torch, work["dtype"])
    )
    model.eval()
    new = work["new_tokens"]
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    result: dict[str, list[float]] = {}
    with torch.inference_mode():
        model.generate(torch.tensor([[100, 200, 300]]), max_new_tokens=2, do_sample=False)
        for batch, repeats in work["batches"].items():
            result[batch] = []
            for prompts in repeats:
                width = max(len(p) for p in prompts)
                ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
                start = time.perf_counter()
                out = model.generate(ids, attention_mask=mask, **kwargs)
                elapsed = time.perf_counter() - start
                if out.shape[1] - width != new:
                    raise SystemExit(f"transformers returned {out.shape[1] - width} tokens")
                result[batch].append(new * len(prompts) / elapsed)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
