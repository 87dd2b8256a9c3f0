"""Tiny random Llama and Qwen2 checkpoints written by transformers, with a word-level tokenizer
and chat template, and transformers' logits to compare against (the model and GEMM tests)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 128
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tokenizer(folder: Path, template_in_jinja_file: bool = False) -> None:
    words = SPECIALS + [f"w{i}" for i in range(VOCAB - len(SPECIALS))]
    tok = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    tcfg = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if template_in_jinja_file:
        (folder / "chat_template.jinja").write_text(TEMPLATE)
    else:
        tcfg["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg))


def randomize_qkv_bias_(model: torch.nn.Module) -> None:
    """Qwen2's Q/K/V biases start at zero: random ones make the bias path matter to a test."""
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.3)


def make_checkpoint(
    folder: Path, family: str, *, rope_scaling=None, tie=False, shard=False, seed=0
) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    if family == "llama":
        cfg = LlamaConfig(**common, rope_theta=10000.0, rope_scaling=rope_scaling)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**common, rope_theta=10000.0)
        model = Qwen2ForCausalLM(cfg)
        randomize_qkv_bias_(model)
    with torch.no_grad():  # RMSNorm weights init to one; make them matter too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.eval()
    model.save_pretrained(folder, max_shard_size="40KB" if shard else "1GB")
    write_tokenizer(folder)
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
