"""Model hyper-parameters read from a Hugging Face ``config.json`` (Llama and Qwen2 families).

The engine needs one flat, validated view of the checkpoint: the decoder, the KV pool sizing and
the sampler all read it. Parsing is strict where a wrong guess would silently produce garbage
(unknown architecture, unknown RoPE scaling) and lenient where transformers itself has defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ModelLoadError(Exception):
    """A checkpoint cannot be loaded; the message names what is missing or unsupported."""


# architectures -> family; the family decides which projections carry biases by default.
_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
_MODEL_TYPES: dict[str, str] = {"llama": "llama", "qwen2": "qwen2"}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCHITECTURES)
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; ``rope_type`` is ``linear`` or ``llama3``."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder and the KV cache need to know about a checkpoint."""

    architecture: str
    family: str  # "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def kv_elements_per_token(self) -> int:
        """KV cache elements one token needs across all layers (multiply by the element size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Parse a ``config.json`` dict; raises ``ModelLoadError`` naming the problem."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in _ARCHITECTURES), None)
        if arch is None:
            model_type = cfg.get("model_type")
            if archs or model_type not in _MODEL_TYPES:
                named = ", ".join(archs) if archs else f"model_type={model_type!r}"
                raise ModelLoadError(
                    f"unsupported architecture {named}; supported: "
                    f"{', '.join(SUPPORTED_ARCHITECTURES)}"
                )
            family = _MODEL_TYPES[str(model_type)]
            arch = "Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"
        family = _ARCHITECTURES[arch]
        if family == "qwen2" and cfg.get("use_sliding_window", False):
            raise ModelLoadError("Qwen2 config with use_sliding_window=true is not supported")

        def need(key: str) -> Any:
            if key not in cfg or cfg[key] is None:
                raise ModelLoadError(f"config.json lacks required field {key!r}")
            return cfg[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelLoadError(
                f"num_attention_heads={heads} not a multiple of kv heads {kv_heads}"
            )

        # transformers 5 nests theta and scaling under rope_parameters; 4.x uses rope_theta and
        # rope_scaling at top level. Accept both.
        rope_params: dict[str, Any] = dict(cfg.get("rope_parameters") or {})
        scaling_src: dict[str, Any] = dict(cfg.get("rope_scaling") or rope_params)
        theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = str(scaling_src.get("rope_type", scaling_src.get("type", "default")))
        if rope_type not in _ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(_ROPE_TYPES)}"
            )
        scaling: RopeScaling | None = None
        if rope_type != "default":
            scaling = RopeScaling(
                rope_type=rope_type,
                factor=float(scaling_src.get("factor", 1.0)),
                low_freq_factor=float(scaling_src.get("low_freq_factor", 1.0)),
                high_freq_factor=float(scaling_src.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(
                    scaling_src.get("original_max_position_embeddings", 8192)
                ),
            )

        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {act!r}; only 'silu' is implemented")

        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = (
            tuple(int(e) for e in eos)
            if isinstance(eos, list)
            else ((int(eos),) if eos is not None else ())
        )
        bos = cfg.get("bos_token_id")
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(need("intermediate_size")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if family == "llama" else False,
            rope_scaling=scaling,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            raw=dict(cfg),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (or a folder holding one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ModelLoadError(f"missing config.json: {p}")
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot parse {p}: {exc}") from exc
        if not isinstance(data, dict):
            raise ModelLoadError(f"{p} is not a JSON object")
        return cls.from_dict(data)
