"""FP8 (e4m3) projections through the linear seam: weights resident at one byte each.

Where the weights come from (`Fp8Source`):

- a checkpoint whose ``config.json`` says ``quantization_config.quant_method`` is ``"fp8"``
  (vLLM's `Fp8LinearMethod` layout: each checkpoint weight ``float8_e4m3fn`` with a float32
  ``weight_scale``, optional static ``input_scale``) or ``"compressed-tensors"`` with 8-bit float
  weights (``float-quantized``: ``weight_scale`` per tensor ``[1]`` or per output channel
  ``[N, 1]``, ``input_scale`` when the activations are static). Block-wise scales
  (``weight_block_size``, ``weight_scale_inv``; a ``block`` strategy) are refused by name;
- ``--quantization fp8`` on a float checkpoint: each projection quantized at load, one scale per
  output channel (``amax / 448``).

Every scale becomes one float32 per output row (a fused Q/K/V keeps each part's own scale), so
`Fp8Linear` holds ``weight`` [N, K] e4m3 and ``weight_scale`` [N]. It runs:

- on CUDA in bf16 (Hopper): activations quantized per token at run time (or with the
  checkpoint's static scale; one Triton kernel, `mstar.kernels.fp8_quant`, where Triton
  imports, else `quantize_activations`' torch ops), then ``torch._scaled_mm`` with row-wise
  scales into bf16;
- elsewhere: the reference path, ``x @ (weight * scale).T`` in the activation dtype: float32
  greedy equals the model whose weights are the dequantized FP8 values, token for token.

The LM head and the embedding stay in the model dtype (as vLLM keeps them).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from mstar.engine.model.config import ModelConfig, ModelLoadError
from mstar.engine.model.family import layer_weight_sources
from mstar.engine.model.linear import (
    DenseLinearMethod,
    LinearMethod,
    LinearSpec,
    MethodPicker,
    copy_rows,
)
from mstar.engine.model.registry import family_named
from mstar.kernels import fp8_quant

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
#: the smallest scale a row gets (an all-zero row would divide by zero)
MIN_SCALE = 1e-12
#: ``torch._scaled_mm`` needs K and N multiples of 16 (cuBLASLt's FP8 alignment)
GEMM_ALIGN = 16


@dataclass(frozen=True)
class Fp8Source:
    """Where a model's FP8 weights come from: ``layout`` "fp8" / "compressed-tensors" (stored
    so), or "quantize" (``--quantization fp8`` on float weights)."""

    layout: str
    #: stored FP8 dequantized to the model dtype at load (``--quantization none``)
    dequantize: bool = False


def _need(ok: bool, field: str, value: Any, served: str) -> None:
    if not ok:
        raise ModelLoadError(f"quantization_config.{field} = {value!r} is not served ({served})")


def fp8_layout(raw_config: Mapping[str, Any]) -> str | None:
    """The checkpoint's FP8 layout from its ``config.json`` ("fp8" / "compressed-tensors"),
    None without a ``quantization_config``; ModelLoadError naming the field that is not served."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    _need(method in ("fp8", "compressed-tensors"), "quant_method", method,
          "fp8 and compressed-tensors float8 checkpoints are")  # fmt: skip
    if method == "fp8":
        block = qc.get("weight_block_size")
        _need(block is None, "weight_block_size", block,
              "block-wise scales (weight_scale_inv); per-tensor and per-channel are")  # fmt: skip
        scheme = qc.get("activation_scheme", "dynamic")
        _need(scheme in ("dynamic", "static"), "activation_scheme", scheme, "dynamic, static")
        return "fp8"
    fmt = qc.get("format", "float-quantized")
    _need(fmt in ("float-quantized", "naive-quantized"), "format", fmt,
          "float-quantized and naive-quantized")  # fmt: skip
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        where = f"config_groups.{name}.weights"
        _need(w.get("type") == "float" and w.get("num_bits") == 8, f"{where}.type/num_bits",
              (w.get("type"), w.get("num_bits")), "8-bit float weights")  # fmt: skip
        strategy = w.get("strategy")
        _need(strategy in ("tensor", "channel"), f"{where}.strategy", strategy,
              "tensor and channel; block-wise scales are refused")  # fmt: skip
        _need(w.get("symmetric", True), f"{where}.symmetric", w.get("symmetric"), "symmetric")
        act = group.get("input_activations")
        if act is not None:
            where = f"config_groups.{name}.input_activations"
            _need(act.get("type") == "float" and act.get("num_bits") == 8, f"{where}.type",
                  act.get("type"), "8-bit float activations")  # fmt: skip
            _need(act.get("strategy") in ("token", "tensor"), f"{where}.strategy",
                  act.get("strategy"), "token and tensor")  # fmt: skip
    return "compressed-tensors"


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 ``w``, float32 scale per row): each row scaled so its largest |value| is 448."""
    wf = w.float()
    scale = (wf.abs().amax(dim=-1) / FP8_MAX).clamp_(min=MIN_SCALE)
    q = (wf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_activations(
    x: torch.Tensor, static_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 ``x`` [M, K], float32 scale [M, 1]): per token (``amax / 448``), or every row by
    the checkpoint's static scale."""
    if static_scale is None:
        scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_(min=MIN_SCALE)
    else:
        scale = static_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
    q = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


class Fp8Linear(nn.Module):
    """A projection with e4m3 weights [N, K] and a float32 scale per output row."""

    def __init__(self, spec: LinearSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.model_dtype = dtype
        self.in_features, self.out_features = spec.in_features, spec.out_features
        n, k = spec.out_features, spec.in_features
        self.weight = nn.Parameter(torch.empty(n, k, dtype=FP8, device=device), False)
        self.weight_scale = nn.Parameter(torch.empty(n, dtype=torch.float32, device=device), False)
        self.bias: nn.Parameter | None = None
        if spec.bias:
            self.bias = nn.Parameter(torch.empty(n, dtype=dtype, device=device), False)
        #: the checkpoint's static activation scale (float32 scalar), None: per token
        self.input_scale: torch.Tensor | None = None
        #: run ``torch._scaled_mm`` (set by `Fp8LinearMethod.finalize` on CUDA bf16)
        self.fp8_gemm = False
        #: the activation quantizer the FP8 GEMM path runs (`quantize_activations`' contract)
        self.quantize: Callable[
            [torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]
        ] = quantize_activations

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights as the float values they stand for: ``weight * scale`` per row."""
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_gemm:
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        xq, x_scale = self.quantize(x, self.input_scale)
        out: torch.Tensor = torch._scaled_mm(
            xq,
            self.weight.t(),  # [K, N] column-major, as the FP8 GEMM takes its second operand
            scale_a=x_scale,
            scale_b=self.weight_scale.view(1, -1),
            out_dtype=x.dtype,
        )
        return out if self.bias is None else out.add_(self.bias)


def fp8_gemm_fits(module: Fp8Linear, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why ``torch._scaled_mm`` cannot run ``module`` (None: it can)."""
    if device.type != "cuda":
        return f"FP8 GEMMs run on CUDA (device {device.type}): dequantized reference path"
    if dtype != torch.bfloat16:
        return f"row-wise FP8 GEMMs write bf16, not {dtype}"
    if module.in_features % GEMM_ALIGN or module.out_features % GEMM_ALIGN:
        return f"[{module.out_features}, {module.in_features}] is not a multiple of {GEMM_ALIGN}"
    return None


class Fp8Checkpoint:
    """The checkpoint tensors a projection is made of (names, stored dtypes, scales)."""

    def __init__(self, files: Mapping[str, Path], sources: Mapping[str, list[str]]) -> None:
        self.files = files
        #: projection name (``layers.3.qkv_proj``) -> its checkpoint weights, in order
        self.sources = sources
        self._dtypes: dict[str, str] = {}

    def _handles(self, stack: ExitStack, names: Sequence[str]) -> dict[Path, Any]:
        shards = {self.files[n] for n in names if n in self.files}
        return {s: stack.enter_context(safe_open(str(s), framework="pt")) for s in shards}

    def stored_fp8(self, spec: LinearSpec) -> bool:
        """Whether the weights fused into ``spec`` are stored as e4m3 (ModelLoadError where
        only some are: a fused projection has one format)."""
        names = self.sources.get(spec.name, [])
        missing = [n for n in names if n not in self._dtypes and n in self.files]
        if missing:
            with ExitStack() as stack:
                handles = self._handles(stack, missing)
                for n in missing:
                    self._dtypes[n] = handles[self.files[n]].get_slice(n).get_dtype()
        fp8 = [self._dtypes.get(n) == "F8_E4M3" for n in names]
        if any(fp8) and not all(fp8):
            stored = {n: self._dtypes.get(n) for n in names}
            raise ModelLoadError(f"{spec.name}: its tensors mix FP8 and other dtypes: {stored}")
        return bool(names) and all(fp8)

    def scales(self, spec: LinearSpec, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight scale per output row [N], largest static input scale or an empty tensor)."""
        names = self.sources[spec.name]
        per_row, inputs = [], []
        with ExitStack() as stack:
            handles = self._handles(stack, [_sibling(n, "weight_scale") for n in names])
            handles |= self._handles(stack, [_sibling(n, "input_scale") for n in names])
            for name, n in zip(names, rows, strict=True):
                scale_name = _sibling(name, "weight_scale")
                scale = self._read(handles, scale_name)
                if scale is None:
                    raise ModelLoadError(f"checkpoint lacks tensor {scale_name!r}")
                if scale.numel() not in (1, n):
                    raise ModelLoadError(
                        f"tensor {scale_name!r} has shape "
                        f"{tuple(scale.shape)}: one scale or one per row ({n}) is served"
                    )
                per_row.append(scale.float().reshape(-1).expand(n))
                given = self._read(handles, _sibling(name, "input_scale"))
                if given is not None:
                    inputs.append(given.float().reshape(-1).max())
        static = torch.stack(inputs).max() if inputs else torch.empty(0)
        return torch.cat(per_row), static

    def _read(self, handles: dict[Path, Any], name: str) -> torch.Tensor | None:
        shard = self.files.get(name)
        if shard is None:
            return None
        tensor: torch.Tensor = handles[shard].get_tensor(name)
        return tensor


def _sibling(weight_name: str, suffix: str) -> str:
    """``...q_proj.weight`` -> ``...q_proj.<suffix>``."""
    return weight_name.rpartition(".")[0] + "." + suffix


class Fp8LinearMethod:
    """`LinearMethod` for the projections `takes` accepts; ``dense`` serves the rest at
    finalize (and every projection when ``source.dequantize``)."""

    def __init__(self, source: Fp8Source, checkpoint: Fp8Checkpoint, dense: LinearMethod) -> None:
        self.source = source
        self.checkpoint = checkpoint
        self.dense = dense
        self._fallbacks: set[str] = set()
        self._triton: Any = None

    def with_dense(self, dense: LinearMethod) -> Fp8LinearMethod:
        """This method with another dense method (the loader's finalize-time one)."""
        twin = Fp8LinearMethod(self.source, self.checkpoint, dense)
        twin._fallbacks, twin._triton = self._fallbacks, self._triton
        return twin

    def _quantizer(self) -> Any:
        """The Triton per-token quantizer (one kernel) where Triton imports and
        ``MSTAR_FP8_TRITON_QUANT`` is not 0; else the torch ops."""
        if self._triton is None:
            use = fp8_quant.available() and os.environ.get("MSTAR_FP8_TRITON_QUANT", "1") != "0"
            self._triton = fp8_quant.load() if use else quantize_activations
            log.info("FP8 activations: %s", "one Triton kernel" if use else "torch ops")
        return self._triton

    def takes(self, spec: LinearSpec) -> bool:
        """Stored FP8 weights; or, quantizing at load, every layer projection (not the head)."""
        if self.source.layout == "quantize":
            return spec.name in self.checkpoint.sources and spec.name != "lm_head"
        return self.checkpoint.stored_fp8(spec)

    def picker(self) -> MethodPicker:
        def pick(spec: LinearSpec) -> LinearMethod:
            return self if self.takes(spec) else self.dense

        return pick

    def create(self, spec: LinearSpec, dtype: torch.dtype, device: torch.device) -> nn.Module:
        return Fp8Linear(spec, dtype, device)

    def load(self, module: nn.Module, kind: str, tensors: Sequence[torch.Tensor]) -> None:
        assert isinstance(module, Fp8Linear)
        if kind == "bias":
            assert module.bias is not None
            copy_rows(module.bias, tensors)
            return
        spec = module.spec
        if self.source.layout == "quantize":
            # on the model's device: an 8B model's 7 G weights quantize in a second on a GPU
            parts = [quantize_rows(t.to(module.weight.device)) for t in tensors]
            copy_rows(module.weight, [q for q, _ in parts])
            copy_rows(module.weight_scale, [s for _, s in parts])
            return
        bad = [str(t.dtype) for t in tensors if t.dtype != FP8]
        if bad:
            raise ValueError(f"{spec.name}: stored {bad}, expected float8_e4m3fn")
        copy_rows(module.weight, tensors)
        per_row, static = self.checkpoint.scales(spec, [t.shape[0] for t in tensors])
        module.weight_scale.copy_(per_row)
        if static.numel():
            module.input_scale = static.to(module.weight.device)

    def finalize(self, spec: LinearSpec, module: nn.Module) -> nn.Module:
        if not isinstance(module, Fp8Linear):
            return self.dense.finalize(spec, module)
        dtype = module.model_dtype
        if self.source.dequantize:
            dense = nn.Linear(module.in_features, module.out_features, module.bias is not None,
                              device=module.weight.device, dtype=dtype)  # fmt: skip
            with torch.no_grad():
                dense.weight.copy_(module.dequantized(dtype))
                if module.bias is not None and dense.bias is not None:
                    dense.bias.copy_(module.bias)
            return self.dense.finalize(spec, dense)
        why = fp8_gemm_fits(module, dtype, module.weight.device)
        module.fp8_gemm = why is None
        if module.fp8_gemm:
            module.quantize = self._quantizer()
        if why is not None and why not in self._fallbacks:
            self._fallbacks.add(why)
            log.info("FP8 %s: %s", spec.name, why)
        return module


def fp8_method(
    folder: Path,
    files: Mapping[str, Path],
    cfg: ModelConfig,
    quantization: str,
    *,
    sharded: bool,
) -> Fp8LinearMethod | None:
    """The FP8 method for a checkpoint folder: stored FP8 (``--quantization auto`` / ``fp8``,
    dequantized with ``none``), float weights quantized with ``fp8``; None otherwise."""
    layout = fp8_layout(json.loads((folder / "config.json").read_text()))
    if layout is None and quantization != "fp8":
        return None
    if sharded:
        raise ModelLoadError(
            "FP8 weights are not sliced for tensor parallelism (--tensor-parallel-size 1 serves "
            "them)"
        )
    dequantize = layout is not None and quantization == "none"
    source = Fp8Source(layout or "quantize", dequantize=dequantize)
    sources = layer_weight_sources(cfg.num_layers, family_named(cfg.family).names)
    if not cfg.tie_word_embeddings:  # an FP8 head is served as stored (never made at load)
        sources["lm_head"] = ["lm_head.weight"]
    method = Fp8LinearMethod(source, Fp8Checkpoint(files, sources), DenseLinearMethod())
    log.info("FP8 weights: %s%s", source.layout, ", dequantized at load" if dequantize else "")
    return method


__all__ = [
    "FP8",
    "Fp8Checkpoint",
    "Fp8Linear",
    "Fp8LinearMethod",
    "Fp8Source",
    "fp8_layout",
    "fp8_method",
    "quantize_activations",
    "quantize_rows",
]
