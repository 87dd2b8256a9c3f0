"""Reading a PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) into
per-projection low-rank weights that match the decoder's fused projections.

PEFT names a checkpoint's own modules (``q_proj``, ``gate_proj``, or a fused checkpoint's
``qkv_proj`` / ``gate_up_proj``); the decoder fuses Q/K/V and gate/up into one projection each,
so every target maps to (projection, part): one output slice of that projection. A target on a
whole fused projection gives every part the same A and its own rows of B.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

#: PEFT module name -> (the decoder's projection, its part; None: every part)
TARGETS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "qkv_proj": ("qkv_proj", None),
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "gate_up_proj": ("gate_up_proj", None),
    "down_proj": ("down_proj", None),
}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter that cannot be served; ``param`` names the request field to blame."""

    def __init__(self, message: str, param: str = "lora_path") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ProjectionShape:
    """One projection a LoRA may target: input width and its parts' output widths."""

    in_features: int
    parts: tuple[int, ...]


@dataclass
class LoraAdapter:
    """An adapter's weights in float32: (projection name, part) -> (A [r, in], B [out_part, r])."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]


def read_config(folder: Path) -> dict[str, object]:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError as exc:
        raise AdapterError(f"{folder} has no {CONFIG_FILE}") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"cannot read {folder / CONFIG_FILE}: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{folder / CONFIG_FILE} is not a JSON object")
    return config


def load_adapter(
    name: str, path: str, projections: dict[str, ProjectionShape], max_rank: int
) -> LoraAdapter:
    """Read and check the adapter at ``path`` against the model's ``projections`` (keyed
    ``layers.N.qkv_proj``); `AdapterError` naming what does not fit."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"LoRA adapter folder {path!r} does not exist")
    config = read_config(folder)
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    for unsupported in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(unsupported):
            raise AdapterError(f"{path}: {unsupported} is not supported")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{path}: rank {rank} is over --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float):
        raise AdapterError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    pairs: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                m = _KEY.search(key)
                if m is None:
                    raise AdapterError(f"{path}: tensor {key!r} is not a LoRA projection weight")
                layer, module, ab = m.groups()
                pairs.setdefault((f"layers.{layer}", module), {})[ab] = f.get_tensor(key)
    except FileNotFoundError as exc:
        raise AdapterError(f"{path} has no {WEIGHTS_FILE}") from exc
    except (OSError, RuntimeError) as exc:  # safetensors' header errors
        raise AdapterError(f"cannot read {folder / WEIGHTS_FILE}: {exc}") from exc
    if not pairs:
        raise AdapterError(f"{path}: {WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in pairs.items():
        if module not in TARGETS:
            raise AdapterError(f"{path}: target module {module!r} is not supported")
        proj, part = TARGETS[module]
        shape = projections.get(f"{layer}.{proj}")
        if shape is None:
            raise AdapterError(f"{path}: the model has no {layer}.{module}")
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: {layer}.{module} lacks lora_A or lora_B")
        a, b = ab["A"].float(), ab["B"].float()
        parts = range(len(shape.parts)) if part is None else (part,)
        out = sum(shape.parts[p] for p in parts)
        if a.shape != (rank, shape.in_features) or b.shape != (out, rank):
            raise AdapterError(
                f"{path}: {layer}.{module} has A {tuple(a.shape)} and B {tuple(b.shape)}; the "
                f"model needs A ({rank}, {shape.in_features}) and B ({out}, {rank})"
            )
        row = 0
        for p in parts:
            weights[(f"{layer}.{proj}", p)] = (a, b[row : row + shape.parts[p]])
            row += shape.parts[p]
    return LoraAdapter(name, path, rank, scaling, weights)
