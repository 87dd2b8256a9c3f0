"""Model hyper-parameters read from a Hugging Face ``config.json``, one flat view for every family.

The engine needs one validated view of the checkpoint: the decoder, the KV pool sizing and the
sampler all read it. Which family a config belongs to, and what is its own, is the registry's
(`mstar.engine.model.registry`); this module parses what the families share. Parsing is strict
where a wrong guess would silently produce garbage (unknown architecture, unknown RoPE scaling)
and lenient where transformers itself has defaults.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mstar.engine.model.moe import MoeSpec


class ModelLoadError(Exception):
    """A checkpoint cannot be loaded; the message names what is missing or unsupported."""


_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
#: hidden_act / hidden_activation values -> the gated MLP's activation
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (`rope.inv_frequencies` reads it); ``rope_type`` is one of
    linear, llama3, yarn, longrope. ``attention_factor`` scales cos/sin (YaRN, LongRoPE)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True)
class Rope:
    """One RoPE table's parameters: its base and its scaling."""

    theta: float
    scaling: RopeScaling | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder and the KV cache need to know about a checkpoint."""

    architecture: str
    family: str  # the registry's family name ("llama", "qwen3", "gemma3", ...)
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
    #: per layer, the keys a query sees (its own included); 0 = every earlier key
    layer_windows: tuple[int, ...] = ()
    #: RoPE of the sliding-window layers where it differs from the full layers' (Gemma 3)
    local_rope: Rope | None = None
    qk_norm: bool = False  # RMSNorm over each head of Q and K before RoPE (Qwen3, Gemma 3)
    norm_offset: bool = False  # Gemma's RMSNorm scales by (1 + w), in float32
    sandwich_norms: bool = False  # Gemma 3: norms after attention and around the MLP too
    hidden_act: str = "silu"  # "silu" or "gelu_tanh", the gated MLP's activation
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size) (in the model dtype)
    query_pre_attn_scalar: float | None = None  # attention scale is its -0.5 power when set
    final_logit_softcap: float | None = None
    #: a learned logit per query head in every attention softmax's denominator (gpt-oss)
    attn_sinks: bool = False
    #: the MoE block of the layers in `moe_layers` (their MLP); None: every MLP is dense
    moe: MoeSpec | None = None
    moe_layers: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def kv_elements_per_token(self) -> int:
        """KV cache elements one token needs across all layers (multiply by the element size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        """Softmax scale of the attention scores."""
        base = self.query_pre_attn_scalar or self.head_dim
        return float(base) ** -0.5

    def window(self, layer: int) -> int:
        """Keys layer ``layer``'s queries see (0: all)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def rope_for(self, layer: int) -> Rope:
        """The RoPE table layer ``layer`` rotates with."""
        if self.local_rope is not None and self.window(layer):
            return self.local_rope
        return Rope(self.rope_theta, self.rope_scaling)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Parse a ``config.json`` dict; raises ``ModelLoadError`` naming the problem."""
        from mstar.engine.model.registry import family_for_config  # the registry imports us

        return family_for_config(cfg).parse(cfg)

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


def _need(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ModelLoadError(f"config.json lacks required field {key!r}")
    return cfg[key]


def parse_rope(cfg: dict[str, Any], params: dict[str, Any] | None = None) -> Rope:
    """A RoPE table from ``params`` (one entry of transformers 5's ``rope_parameters``) or, for
    transformers 4 configs, the top-level ``rope_theta`` / ``rope_scaling``."""
    if params is None:
        params = dict(cfg.get("rope_parameters") or {})
    scaling_src: dict[str, Any] = dict(cfg.get("rope_scaling") or params)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = str(scaling_src.get("rope_type", scaling_src.get("type", "default")))
    if rope_type == "su":  # early Phi-3 configs' name for LongRoPE
        rope_type = "longrope"
    if rope_type not in _ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(_ROPE_TYPES)}"
        )
    partial = float(scaling_src.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1)))
    if partial != 1.0:
        raise ModelLoadError(f"unsupported partial_rotary_factor {partial}; only 1.0")
    if rope_type == "default":
        return Rope(theta)
    orig = scaling_src.get("original_max_position_embeddings")
    orig = int(orig or cfg.get("original_max_position_embeddings") or 8192)
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    factor = scaling_src.get("factor")
    if factor is None and rope_type in ("yarn", "longrope"):
        factor = max_pos / orig
    factor = float(1.0 if factor is None else factor)
    attention_factor = scaling_src.get("attention_factor")
    if attention_factor is None:
        attention_factor = _attention_factor(rope_type, factor, orig, scaling_src)
    return Rope(
        theta,
        RopeScaling(
            rope_type=rope_type,
            factor=factor,
            low_freq_factor=float(scaling_src.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling_src.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=orig,
            beta_fast=float(scaling_src.get("beta_fast") or 32),
            beta_slow=float(scaling_src.get("beta_slow") or 1),
            truncate=bool(scaling_src.get("truncate", True)),
            attention_factor=float(attention_factor),
            short_factor=tuple(float(f) for f in scaling_src.get("short_factor") or ()),
            long_factor=tuple(float(f) for f in scaling_src.get("long_factor") or ()),
        ),
    )


def _attention_factor(rope_type: str, factor: float, orig: int, src: dict[str, Any]) -> float:
    """transformers' default cos/sin scale for YaRN (the paper's mscale) and LongRoPE."""
    if rope_type == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    if rope_type != "yarn":
        return 1.0

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = src.get("mscale"), src.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, float(m)) / mscale(factor, float(m_all))
    return mscale(factor)


def layer_windows(cfg: dict[str, Any], num_layers: int, *, enabled: bool = True) -> tuple[int, ...]:
    """Per-layer sliding windows: ``layer_types``' sliding layers where the config lists them,
    else every layer when ``sliding_window`` is set (Mistral, Phi-3); () when none."""
    window = cfg.get("sliding_window")
    if not enabled or not window:
        return ()
    types = cfg.get("layer_types")
    if types is None:
        return (int(window),) * num_layers
    if len(types) != num_layers:
        raise ModelLoadError(f"layer_types lists {len(types)} layers, config has {num_layers}")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ModelLoadError(f"unsupported layer_types {sorted(unknown)}")
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def parse_common(cfg: dict[str, Any], architecture: str, family: str, **own: Any) -> ModelConfig:
    """The fields every family reads the same way; ``own`` (a family's) overrides them."""
    hidden = int(_need(cfg, "hidden_size"))
    heads = int(_need(cfg, "num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ModelLoadError(f"num_attention_heads={heads} not a multiple of kv heads {kv_heads}")
    layers = int(_need(cfg, "num_hidden_layers"))
    act_name = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act_name not in _ACTIVATIONS:
        raise ModelLoadError(
            f"unsupported hidden_act {act_name!r}; supported: {', '.join(_ACTIVATIONS)}"
        )
    eos = cfg.get("eos_token_id")
    eos_ids = (
        tuple(int(e) for e in eos)
        if isinstance(eos, list)
        else ((int(eos),) if eos is not None else ())
    )
    bos = cfg.get("bos_token_id")
    attention_bias = bool(cfg.get("attention_bias", False))
    rope = parse_rope(cfg)
    fields: dict[str, Any] = dict(
        architecture=architecture,
        family=family,
        vocab_size=int(_need(cfg, "vocab_size")),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(_need(cfg, "intermediate_size")),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope.theta,
        rope_scaling=rope.scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        layer_windows=layer_windows(cfg, layers),
        hidden_act=_ACTIVATIONS[act_name],
        raw=dict(cfg),
    )
    fields.update(own)
    return ModelConfig(**fields)
