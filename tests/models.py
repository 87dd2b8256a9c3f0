"""Model folders for tests: tiny random Llama/Qwen2 checkpoints and the real SmolLM2.

Tiny models are built with transformers from a fixed seed and saved in the Hugging Face layout
our loader reads, with a word-level tokenizer over their whole vocabulary; the real model is
the packaged SmolLM2 converted once per machine into the engine's cache folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_VOCAB = 96
#: user questions of mixed lengths for the real-model tests' chat and raw prompts
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves falling on a quiet pond.",
    "Hi",
    "Explain, in two sentences, why the sky looks blue during the day and red at sunset.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Describe a cat.",
]


def build_tiny_model(folder: Path, family: str = "llama", **overrides: object) -> Path:
    """Write a tiny random `family` ("llama" or "qwen2") checkpoint + tokenizer into `folder`."""
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    common: dict[str, object] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=family == "qwen2",
    )
    common.update(overrides)
    torch.manual_seed(1234)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        raise ValueError(family)
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(TINY_VOCAB)}
    tok = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "w1", "eos_token": "w2", "unk_token": "w0"})
    )
    return folder


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding effects).

    A plain argmax loop over the model with its own KV cache, as `generate(do_sample=False)`
    does, but never stopping at EOS (the engine runs these with `ignore_eos`).
    """
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model(torch.tensor([prompt]), use_cache=True)
            tokens: list[int] = []
            for _ in range(max_new_tokens):
                tokens.append(int(out.logits[0, -1].argmax()))
                nxt = torch.tensor([[tokens[-1]]])
                if "cache" in out:  # transformers >= 5.2x names it `cache`
                    out = model(nxt, cache=out["cache"], use_cache=True)
                else:
                    out = model(nxt, past_key_values=out["past_key_values"], use_cache=True)
            outs.append(tokens)
    return outs
