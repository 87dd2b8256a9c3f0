"""GGUF-quantized projections through the linear seam: the file's blocks stay the weights.

`GGUFWeights` reads a GGUF file's tensors as stored (`gguf_quant.read_stored`) and picks, per
projection, `GGUFLinearMethod` where every checkpoint tensor fused into it is a type
`QuantLinear` serves and its rows are whole blocks; anything else (F32/F16 tensors, a type not
served) stays with the dense method. The quantized module holds only the bias until
`finalize` copies the raw blocks out of the file: one `QuantLinear` when the parts share a type,
else one per part with their outputs concatenated (a Q4_K_M file mixes Q4_K q/k with Q6_K v).
The float tensors the loader hands `load` are only checked against the spec, never kept: the
resident size is the file's. A tied LM head is the embedding's blocks, and so is the lookup
(`QuantEmbedding`). `QuantDecodeWeights` gathers every layer's blocks for the fused C++ decode
(`cpu_kernels.quant_decode_layers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mstar.engine.model.config import ModelConfig
from mstar.engine.model.family import NameMap, layer_weight_sources
from mstar.engine.model.gguf_quant import StoredTensor, read_stored
from mstar.engine.model.layers import PROJECTIONS
from mstar.engine.model.linear import LinearSpec, ShapeMismatch, copy_rows
from mstar.kernels.quant_linear import QuantLinear, row_bytes, served


class QuantSlot(nn.Module):
    """A quantized projection before `GGUFLinearMethod.finalize`: its bias only."""

    def __init__(self, spec: LinearSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.bias: nn.Parameter | None = None
        if spec.bias:
            empty = torch.empty(spec.out_features, dtype=dtype, device=device)
            self.bias = nn.Parameter(empty, requires_grad=False)


class ConcatQuantLinear(nn.Module):
    """A fused projection whose parts are stored in different types: each part's
    `QuantLinear`, outputs concatenated in order (the rows the fused weight would hold)."""

    def __init__(self, parts: Sequence[QuantLinear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class QuantEmbedding(nn.Module):
    """A tied embedding looked up in its LM head's blocks: each id's row dequantized (exactly
    the values the float copy held, which is dropped: Gemma 3 270M's 671 MB float32 table).

    ``weight``: an empty tensor of the dtype and device, which `Decoder.dtype` reads."""

    def __init__(self, head: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self._head = [head]  # a list: the blocks stay the head's, counted once
        self.dim = head.in_features
        self.dtype = dtype
        self.register_buffer("weight", torch.empty(0, self.dim, dtype=dtype), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self._head[0]
        flat = ids.reshape(-1)
        out = torch.empty(flat.numel(), self.dim, dtype=self.dtype)
        head.kernels.quant_dequantize_(head.blocks.index_select(0, flat), head.qtype, out)
        return out.reshape(*ids.shape, self.dim)


def share_tied_embedding(decoder: nn.Module) -> bool:
    """Look a tied embedding up in the quantized LM head's blocks; False where the head is
    not one `QuantLinear` (the float embedding stays)."""
    head = getattr(decoder, "lm_head", None)
    embed = getattr(decoder, "embed_tokens", None)
    if not isinstance(head, QuantLinear) or not isinstance(embed, nn.Embedding):
        return False
    decoder.embed_tokens = QuantEmbedding(head, embed.weight.dtype)
    return True


class GGUFWeights:
    """A GGUF file's stored tensors and the projections kept quantized (`takes`)."""

    def __init__(self, path: str | Path, cfg: ModelConfig, names: NameMap) -> None:
        self.stored: dict[str, StoredTensor] = {t.name: t for t in read_stored(path)}
        #: projection name (``layers.3.qkv_proj``) -> the checkpoint weights fused into it
        self.sources = layer_weight_sources(cfg.num_layers, names)
        # A tied head multiplies the embedding's blocks as stored, as llama.cpp does with a
        # file that has no output tensor (the lookup then reads the same blocks:
        # `share_tied_embedding`): a Q8_0 head reads 0.53x of bf16's bytes, a third of
        # SmolLM2's step.
        tied = cfg.tie_word_embeddings
        self.sources["lm_head"] = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
        self._takes: dict[str, bool] = {}

    def takes(self, spec: LinearSpec) -> bool:
        """True when every part of ``spec`` is stored in a served type, whole blocks a row."""
        if spec.name not in self._takes:
            parts = [self.stored.get(n) for n in self.sources.get(spec.name, ())]
            ok = bool(parts) and all(p is not None and p.quantized for p in parts)
            ok = ok and all(served(p.qtype) for p in parts if p is not None)
            if ok:
                try:
                    for p in parts:
                        if p is not None:
                            row_bytes(p.qtype, spec.in_features)
                except ValueError:
                    ok = False
            self._takes[spec.name] = ok
        return self._takes[spec.name]

    def parts(self, spec: LinearSpec) -> list[StoredTensor]:
        return [self.stored[n] for n in self.sources[spec.name]]

    def release(self) -> None:
        """Drop the file's mapping once every projection holds a copy of its blocks (the
        `takes` answers stay)."""
        self.stored = {}


class GGUFLinearMethod:
    """`LinearMethod` over GGUF blocks; ``kernels``: `cpu_kernels.load()`'s extension."""

    def __init__(self, weights: GGUFWeights, kernels: Any) -> None:
        self.weights = weights
        self.kernels = kernels

    def create(self, spec: LinearSpec, dtype: torch.dtype, device: torch.device) -> nn.Module:
        return QuantSlot(spec, dtype, device)

    def load(self, module: nn.Module, kind: str, tensors: Sequence[torch.Tensor]) -> None:
        if kind == "bias":
            assert isinstance(module, QuantSlot) and module.bias is not None
            copy_rows(module.bias, tensors)
            return
        assert isinstance(module, QuantSlot)
        spec = module.spec
        shapes = [tuple(t.shape) for t in tensors]
        fits = all(len(s) == 2 and s[1] == spec.in_features for s in shapes)
        if not fits or sum(s[0] for s in shapes) != spec.out_features:
            raise ShapeMismatch(
                f"shapes {shapes} do not fill [{spec.out_features}, {spec.in_features}]"
            )

    def finalize(self, spec: LinearSpec, module: nn.Module) -> nn.Module:
        if not isinstance(module, QuantSlot):
            return module
        parts = self.weights.parts(spec)
        for p in parts:
            if p.shape[-1] != spec.in_features:
                raise ShapeMismatch(f"{p.name}: shape {p.shape}, spec in {spec.in_features}")
        if sum(p.shape[0] for p in parts) != spec.out_features:
            raise ShapeMismatch(f"{spec.name}: parts fill {[p.shape for p in parts]}")
        bias = None if module.bias is None else module.bias.detach()
        if len({p.qtype for p in parts}) == 1:
            blocks = torch.from_numpy(np.concatenate([p.data for p in parts]))
            return QuantLinear(blocks, parts[0].qtype, spec.in_features, bias, kernels=self.kernels)
        linears, row = [], 0
        for p in parts:
            rows = p.shape[0]
            part_bias = None if bias is None else bias[row : row + rows].clone()
            blocks = torch.from_numpy(np.array(p.data))
            linears.append(
                QuantLinear(blocks, p.qtype, spec.in_features, part_bias, kernels=self.kernels)
            )
            row += rows
        return ConcatQuantLinear(linears)


@dataclass(frozen=True)
class QuantDecodeWeights:
    """Every layer's weights as `cpu_kernels.quant_decode_layers` takes them: each projection
    a `QuantLinear` or a `ConcatQuantLinear` of them (its parts' blocks and types in order),
    and the most rows their integer kernel takes (past it a `QuantLinear` dequantizes)."""

    norm_in: list[torch.Tensor]
    norm_post: list[torch.Tensor]
    blocks: list[torch.Tensor]
    types: list[int]
    #: parts per projection, 4 per layer
    parts: list[int]
    biases: list[torch.Tensor | None]
    max_rows: int

    @staticmethod
    def gather(layers: Any) -> QuantDecodeWeights | None:
        """The bundle, or None where a projection is not all GGUF blocks."""
        blocks: list[torch.Tensor] = []
        types: list[int] = []
        counts: list[int] = []
        biases: list[torch.Tensor | None] = []
        max_rows = 1 << 30
        for layer in layers:
            dtype = layer.input_layernorm.weight.dtype
            for name in PROJECTIONS:
                linear = getattr(layer, name)
                held = list(linear.parts) if isinstance(linear, ConcatQuantLinear) else [linear]
                parts = [p for p in held if isinstance(p, QuantLinear)]
                if len(parts) != len(held):
                    return None
                blocks += [p.blocks for p in parts]
                types += [p.qtype for p in parts]
                counts.append(len(parts))
                part_biases = [p.bias for p in parts if p.bias is not None]
                biases.append(torch.cat(part_biases).to(dtype) if part_biases else None)
                max_rows = min(max_rows, *(p.dequant_min_rows - 1 for p in parts))
        return QuantDecodeWeights(
            norm_in=[layer.input_layernorm.weight.detach() for layer in layers],
            norm_post=[layer.mlp_norm.weight.detach() for layer in layers],
            blocks=blocks,
            types=types,
            parts=counts,
            biases=biases,
            max_rows=max_rows,
        )

    def kernel_call(self) -> tuple[str, tuple[Any, ...]]:
        weights = (self.norm_in, self.norm_post, self.blocks, self.types, self.parts)
        return "quant_decode_layers", (*weights, self.biases)
