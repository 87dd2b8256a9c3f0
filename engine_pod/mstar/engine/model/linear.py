"""The linear-method seam: every projection of every family is built, loaded and finalised by
one `LinearMethod`, chosen per weight.

A decoder asks for a projection by `LinearSpec` (its name, shapes, bias, and how tensor
parallelism would split it) and never names a class. The loader then fills it through
`LinearMethod.load` (row blocks: fused Q/K/V and gate/up) and, once every weight is in,
`finalize_linears` lets the method swap the module for its runtime form. Today's method
(`DenseLinearMethod`) builds ``nn.Linear`` and finalises to oneDNN/kernel-packed
`PackedLinear`; `gguf_linear.GGUFLinearMethod` keeps a GGUF file's quantized blocks
(`QuantLinear`); `tp.TPLinearMethod` wraps either for one tensor-parallel rank,
sharding at ``load`` by ``spec.parallel``: "column" (output rows split) or "row" (input
columns split, output all-reduced). Planned: LoRA, a method wrapping another method's
finalised module, plugs in the same way, without touching a family.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from mstar.kernels.cpu_gemm import PackedLinear


@dataclass(frozen=True)
class LinearSpec:
    """One projection: ``name`` as the decoder holds it (``layers.3.qkv_proj``, ``lm_head``)."""

    name: str
    in_features: int
    out_features: int
    bias: bool
    #: how tensor parallelism splits it: "column" (outputs), "row" (inputs), "replicated"
    parallel: str = "column"
    #: output widths of the checkpoint tensors fused into it, in order (q, k, v / gate, up)
    parts: tuple[int, ...] = ()


class LinearMethod(Protocol):
    """How one kind of weight is built, loaded and run."""

    def create(self, spec: LinearSpec, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """An empty module for ``spec`` (weights are loaded next); ``device`` may be meta."""
        ...

    def load(self, module: nn.Module, kind: str, tensors: Sequence[torch.Tensor]) -> None:
        """Fill ``module``'s ``kind`` ("weight" / "bias") from the checkpoint's tensors, which
        stack as consecutive output rows."""
        ...

    def finalize(self, spec: LinearSpec, module: nn.Module) -> nn.Module:
        """The module that runs, once every weight is loaded."""
        ...


class DenseLinearMethod:
    """``nn.Linear`` in the checkpoint's dtype; finalised to `PackedLinear` when ``pack``."""

    def __init__(
        self,
        *,
        pack: bool = False,
        float32_gemm: bool = False,
        kernels: Any | None = None,
        deterministic: bool = False,
    ) -> None:
        self.pack = pack
        self.float32_gemm = float32_gemm
        self.kernels = kernels
        self.deterministic = deterministic

    def create(self, spec: LinearSpec, dtype: torch.dtype, device: torch.device) -> nn.Module:
        return nn.Linear(spec.in_features, spec.out_features, spec.bias, device=device, dtype=dtype)

    def load(self, module: nn.Module, kind: str, tensors: Sequence[torch.Tensor]) -> None:
        copy_rows(getattr(module, kind), tensors)

    def finalize(self, spec: LinearSpec, module: nn.Module) -> nn.Module:
        if not self.pack or not isinstance(module, nn.Linear):
            return module
        return PackedLinear(
            module,
            float32_gemm=self.float32_gemm,
            kernels=self.kernels,
            deterministic=self.deterministic,
        )


class ShapeMismatch(ValueError):
    """A checkpoint tensor does not fit the rows the config implies."""


def copy_rows(dst: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``tensors`` into consecutive row blocks of ``dst``; they must fill it exactly."""
    row = 0
    for src in tensors:
        block = dst[row : row + src.shape[0]]
        if block.shape != src.shape:
            raise ShapeMismatch(f"shape {tuple(src.shape)}, rows {row}.. of {tuple(dst.shape)}")
        block.copy_(src)
        row += src.shape[0]
    if row != dst.shape[0]:
        raise ShapeMismatch(f"fill {row} rows of {dst.shape[0]}")


#: picks the method for each projection (one method for all today)
MethodPicker = Callable[[LinearSpec], LinearMethod]


class Linears:
    """A decoder's projections: built through the picker, finalised in place after loading."""

    def __init__(self, picker: MethodPicker) -> None:
        self.picker = picker
        self.specs: dict[str, LinearSpec] = {}

    def create(self, spec: LinearSpec, dtype: torch.dtype, device: torch.device) -> nn.Module:
        self.specs[spec.name] = spec
        return self.picker(spec).create(spec, dtype, device)

    def method(self, name: str) -> LinearMethod:
        return self.picker(self.specs[name])

    def finalize(self, root: nn.Module, picker: MethodPicker | None = None) -> None:
        """Swap every projection of ``root`` for its method's runtime module (``picker``:
        the methods chosen at load, e.g. packing once the CPU kernels are known)."""
        if picker is not None:
            self.picker = picker
        for name, spec in self.specs.items():
            parent_name, _, attr = name.rpartition(".")
            parent = root.get_submodule(parent_name) if parent_name else root
            setattr(parent, attr, self.picker(spec).finalize(spec, getattr(parent, attr)))
