"""Offline throughput: mstar's engine beside `transformers.generate`, same prompts, same run.

SmolLM2-135M-Instruct (the packaged default), greedy, 32 new tokens per prompt, at batch 1, 8
and 32. transformers runs each batch as one left-padded `generate` call. Prints output tokens/s
for both (best of `--repeat` runs each, after a warm-up) and their ratio.

    python bench/bench_throughput.py [--dtype bfloat16] [--batches 1 8 32] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import time

import torch

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.model.gguf_convert import default_model_path
from mstar.engine.sampling_params import SamplingParams

PROMPTS = [
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "Explain how a bicycle works.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What does a compiler do?",
    "Describe the water cycle.",
]


def _prompt_ids(engine: LLMEngine, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    texts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(n)]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


def bench_mstar(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, repeat: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    best = 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        best = max(best, sum(len(o) for o in outs) / (time.perf_counter() - start))
    return best


def bench_transformers(
    folder: str, dtype: torch.dtype, prompts: list[list[int]], new: int, repeat: int
) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=2, do_sample=False)
        best = 0.0
        for _ in range(repeat):
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, **kwargs)
            elapsed = time.perf_counter() - start
            best = max(best, (out.shape[1] - width) * len(prompts) / elapsed)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs each")
    args = parser.parse_args()
    folder = str(default_model_path())
    engine = LLMEngine.from_config(
        EngineConfig(model=folder, dtype=args.dtype, device="cpu", max_num_seqs=64)
    )
    dtype = engine.dtype
    print(
        f"SmolLM2-135M {args.dtype}, greedy, {args.new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'batch':>5} | {'mstar tok/s':>11} | {'transformers tok/s':>18} | {'ratio':>6}")
    print("-" * 50)
    for bs in args.batches:
        prompts = _prompt_ids(engine, bs)
        ours = bench_mstar(engine, prompts, args.new_tokens, args.repeat)
        theirs = bench_transformers(folder, dtype, prompts, args.new_tokens, args.repeat)
        print(f"{bs:>5} | {ours:>11.1f} | {theirs:>18.1f} | {ours / theirs:>5.2f}x")


if __name__ == "__main__":
    main()
