"""Random PEFT LoRA adapters for tests, made with peft itself on a tiny model's folder, and
peft's greedy output as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: every projection a Llama-family block has, as PEFT names them
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(
    base: Path, folder: Path, rank: int, seed: int, targets: list[str] | None = None,
    *, alpha: int | None = None, rslora: bool = False,
) -> Path:  # fmt: skip
    """A rank-``rank`` adapter of ``base`` on ``targets`` with random A and B (B is zero in a
    fresh PEFT adapter: random here, so the adapter changes the output)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha or 2 * rank,
        target_modules=targets or ALL_PROJECTIONS,
        use_rslora=rslora,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(str(folder))
    return folder


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers + peft greedy decoding of ``prompt`` in float32 (the base alone when
    ``adapter`` is None): an argmax loop over the whole sequence each token, never stopping at
    EOS (the engine runs these with `ignore_eos`)."""
    import transformers
    from peft import PeftModel

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            logits = model(input_ids=torch.tensor([tokens])).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]
