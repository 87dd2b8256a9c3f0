"""Load a Hugging Face checkpoint folder (or a GGUF file) into the engine's ``Decoder``.

Reads config.json, the safetensors weights (one file or shards listed by
model.safetensors.index.json) and the tokenizer files. Weights are copied straight into a
decoder allocated without random initialisation, through the family's checkpoint name map
and each projection's linear method (fusing Q/K/V and gate/up on the way), so a cached 135M
model loads in a fraction of a second.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from mstar.engine.config import QUANTIZATIONS
from mstar.engine.model.config import ModelConfig, ModelLoadError
from mstar.engine.model.decoder import Decoder, fused_decode_refusal
from mstar.engine.model.fp8 import fp8_method
from mstar.engine.model.gguf_convert import gguf_folder
from mstar.engine.model.gguf_linear import (
    GGUFLinearMethod,
    GGUFWeights,
    QuantDecodeWeights,
    share_tied_embedding,
)
from mstar.engine.model.layers import RMSNorm
from mstar.engine.model.linear import (
    DenseLinearMethod,
    LinearMethod,
    LinearSpec,
    MethodPicker,
    ShapeMismatch,
)
from mstar.engine.model.moe import MoeBlock, load_moe_block_
from mstar.engine.model.registry import family_named
from mstar.engine.model.tokenizer import Tokenizer
from mstar.engine.model.tp import TPRank, TPShard
from mstar.kernels import cpu_kernels
from mstar.kernels.cpu_gemm import can_pack, cpu_has_bf16

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

log = logging.getLogger(__name__)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` (or a torch dtype) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ModelLoadError(
            f"unsupported dtype {dtype!r}; use one of {', '.join(sorted(_DTYPES))}"
        ) from None


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> file, from the shard index or by listing every *.safetensors file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot parse {index}: {exc}") from exc
        files = {name: folder / fname for name, fname in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise ModelLoadError(f"missing weight shard {shard.name} listed in {index.name}")
        return files
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"missing weights: no *.safetensors file in {folder}")
    files = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                files[name] = shard
    return files


class _WeightReader(Mapping[str, torch.Tensor]):
    """Opens each shard once and hands out tensors by HF name (a mapping, as
    `load_moe_block_` reads it)."""

    def __init__(self, files: dict[str, Path], stack: ExitStack) -> None:
        self._files = files
        self._handles = {
            shard: stack.enter_context(safe_open(str(shard), framework="pt"))
            for shard in sorted(set(files.values()))
        }

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def __getitem__(self, name: str) -> torch.Tensor:
        shard = self._files.get(name)
        if shard is None:
            raise ModelLoadError(f"checkpoint lacks tensor {name!r}")
        tensor: torch.Tensor = self._handles[shard].get_tensor(name)
        return tensor


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ModelLoadError(
            f"tensor {name!r} has shape {tuple(src.shape)}, config implies {tuple(dst.shape)}"
        )
    dst.copy_(src)


def _load_layer(
    model: Decoder, reader: _WeightReader, i: int, names: list[str], local: str
) -> None:
    """One decoder parameter of layer ``i`` from its checkpoint tensors: a projection through
    its linear method (whatever parameters that method's module holds), a norm through
    `RMSNorm.load_`, an MoE block (``local`` "moe", ``names`` its checkpoint module) through
    `load_moe_block_`; what the config does not have (a bias, a q/k norm) is skipped."""
    if local == "sinks":  # gpt-oss: one float32 logit per query head
        sinks = getattr(model.layers[i], "sinks", None)
        if isinstance(sinks, torch.Tensor):
            _copy(sinks, reader[names[0]], names[0])
        return
    if local == "moe":
        block = getattr(model.layers[i], "moe", None)
        if isinstance(block, MoeBlock):
            try:
                load_moe_block_(block, reader, names[0])
            except ValueError as exc:
                raise ModelLoadError(str(exc)) from exc
        return
    module_name, _, kind = local.rpartition(".")
    full = f"layers.{i}.{module_name}"
    spec = model.linears.specs.get(full)
    if spec is None and getattr(model.layers[i], module_name, None) is None:
        return
    if spec is not None and kind == "bias" and not spec.bias:
        return
    module = model.get_submodule(full)
    try:
        if spec is not None:
            model.linears.method(full).load(module, kind, [reader[n] for n in names])
        elif isinstance(module, RMSNorm):
            (name,) = names
            module.load_(reader[name])
        else:
            raise ModelLoadError(f"no loader for {full}.{kind}")
    except (ShapeMismatch, ValueError) as exc:
        raise ModelLoadError(f"tensors {names}: {exc}") from exc


def build_decoder(
    cfg: ModelConfig,
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    linear_method: MethodPicker | None = None,
    shard: TPShard | None = None,
) -> Decoder:
    """Allocate a decoder without random init and fill it from the folder's safetensors
    (``linear_method``: each projection's method, default dense; ``shard``: this rank's
    slice of a tensor-parallel model, its projections' methods already `TPShard.picker`'s)."""
    model = Decoder(
        cfg if shard is None else shard.local_config(),
        dtype=dtype,
        device=device,
        max_positions=max_positions,
        init_weights=False,
        linear_method=linear_method,
    )
    names = family_named(cfg.family).names
    params = dict(model.named_parameters(remove_duplicate=False))
    files = _weight_files(folder)
    with ExitStack() as stack, torch.no_grad():
        # Copies are memory-bound: extra threads add nothing and, on a busy host, spin-wait for
        # seconds (measured: 0.27 s single-threaded vs 1.2-3.5 s with 2 threads for 540 MB).
        threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(1)
            stack.callback(torch.set_num_threads, threads)
        reader = _WeightReader(files, stack)
        embed = reader["model.embed_tokens.weight"]
        if shard is not None:
            embed = shard.vocab_rows(embed)
        _copy(params["embed_tokens.weight"], embed, "model.embed_tokens.weight")
        model.norm.load_(reader["model.norm.weight"])
        if not cfg.tie_word_embeddings:
            if "lm_head.weight" not in reader:
                raise ModelLoadError(
                    "checkpoint lacks tensor 'lm_head.weight' and tie_word_embeddings is false"
                )
            head = [reader["lm_head.weight"]]
            try:
                model.linears.method("lm_head").load(model.lm_head, "weight", head)
            except (ShapeMismatch, ValueError) as exc:
                raise ModelLoadError(f"tensor 'lm_head.weight': {exc}") from exc
        for i in range(cfg.num_layers):
            for local, tensors in names(i):
                _load_layer(model, reader, i, tensors, local)
    if shard is not None:
        model.embed_tokens = shard.shard_embedding(model.embed_tokens)
    model.eval()
    return model


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    *,
    max_positions: int | None = None,
    deterministic: bool = False,
    quantization: str = "auto",
    tp: TPRank | None = None,
) -> tuple[Decoder, ModelConfig, Tokenizer]:
    """Load a Hugging Face folder (or a ``.gguf`` file) of a registered family ->
    (decoder, config, tokenizer).

    ``deterministic`` (CPU): batch-invariant GEMMs and norms (`DenseLinearMethod`, `Decoder`).
    ``quantization`` (`QUANTIZATIONS`): "auto" keeps a GGUF file's quantized projections in
    their blocks (`GGUFLinearMethod`, CPU, float32 or bf16) where `_gguf_method` allows it,
    and an FP8 checkpoint's e4m3 weights (`fp8.Fp8LinearMethod`); "none" serves the
    dequantized conversion; "fp8" quantizes float projections to e4m3 at load.
    ``tp``: build this rank's shard of a tensor-parallel model (`mstar.engine.model.tp`); the
    config returned is the whole model's, the decoder's (``decoder.config``) this rank's.

    Raises ``ModelLoadError`` naming the missing path, file or tensor, or the unsupported
    architecture.
    """
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(
            f"unsupported quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)}"
        )
    folder = Path(path).expanduser()
    gguf_file = None
    if folder.suffix == ".gguf" and folder.is_file():
        gguf_file = folder
        folder = gguf_folder(folder)  # converted once into the cache, then loaded from there
    if not folder.exists():
        raise ModelLoadError(f"model path does not exist: {folder}")
    if not folder.is_dir():
        raise ModelLoadError(f"model path is not a directory: {folder}")
    cfg = ModelConfig.from_file(folder / "config.json")
    torch_dtype = resolve_dtype(dtype)
    tokenizer = Tokenizer.from_dir(folder, extra_eos_ids=cfg.eos_token_ids, bos_id=cfg.bos_token_id)
    dev = torch.device(device)
    kernels = cpu_kernels.load() if dev.type == "cpu" else None
    shard = None if tp is None or tp.size == 1 else TPShard.of(tp, cfg)
    quant = None
    if gguf_file is not None and quantization == "auto":
        quant = _gguf_method(gguf_file, cfg, torch_dtype, dev, kernels, deterministic, shard)
    fp8 = fp8_method(folder, _weight_files(folder), cfg, quantization, sharded=shard is not None)
    picker = fp8.picker() if fp8 else _sharded(shard, _picker(quant, DenseLinearMethod()))
    decoder = build_decoder(cfg, folder, torch_dtype, dev, max_positions, picker, shard)
    held, active = decoder.parameter_counts
    log.info("%s: %d parameters held, %d active per token", cfg.family, held, active)
    method = DenseLinearMethod(
        pack=can_pack(torch_dtype, decoder.device),
        float32_gemm=bf16_float32_gemm(torch_dtype),
        kernels=kernels,
        deterministic=deterministic,
    )
    refusal = fused_decode_refusal(cfg, family_named(cfg.family).fused_decode)
    if shard is not None:  # its all-reduces sit between the kernel's projections
        refusal = ", ".join(r for r in (refusal, "tensor parallelism") if r)
    if quant is not None:
        specs = decoder.linears.specs.values()
        kept = sorted(s.name for s in specs if quant.weights.takes(s))
        log.info("GGUF: %d of %d projections served quantized as stored", len(kept), len(specs))
    final = fp8.with_dense(method).picker() if fp8 else _sharded(shard, _picker(quant, method))
    for block in decoder.moe_blocks() if kernels is not None else ():
        block.use_cpu_kernels(kernels, method)  # packed once (the plain stacks dropped)
    decoder.finalize_linears(final, fused=kernels is not None and refusal is None)
    if quant is not None:
        quant.weights.release()
        if cfg.tie_word_embeddings and share_tied_embedding(decoder):
            log.info("GGUF: the tied embedding is looked up in the LM head's blocks")
    if kernels is not None:
        if decoder.fused_decode is not None:
            stored = isinstance(decoder.fused_decode, QuantDecodeWeights)
            how = "GGUF blocks as stored" if stored else "packed float"
            log.info("%s: decode steps run every layer in one fused CPU kernel call (weights: %s)",
                     cfg.family, how)  # fmt: skip
        else:
            why = refusal or "a projection runs outside the small-batch kernels"
            log.info("%s: fused CPU decode off (%s); decode steps run layer by layer",
                     cfg.family, why)  # fmt: skip
    decoder.cpu_kernels = kernels
    decoder.deterministic = deterministic
    return decoder, cfg, tokenizer


def _picker(quant: GGUFLinearMethod | None, dense: LinearMethod) -> MethodPicker:
    """Quantized where ``quant`` takes the projection, else ``dense``."""

    def pick(spec: LinearSpec) -> LinearMethod:
        return quant if quant is not None and quant.weights.takes(spec) else dense

    return pick


def _sharded(shard: TPShard | None, picker: MethodPicker) -> MethodPicker:
    return picker if shard is None else shard.picker(picker)


def stored_gguf_refusal(
    *,
    sharded: bool,
    device: torch.device,
    dtype: torch.dtype | None,
    kernels: object | None,
    deterministic: bool,
) -> str | None:
    """Why a GGUF's projections cannot stay in their blocks under these settings, or None.
    ``dtype`` None: not chosen yet (the engine asks before picking it, `engine._serves_stored`;
    the file's own blocks can still refuse at load)."""
    if sharded:
        return "quantized blocks are not sliced for tensor parallelism"
    if device.type != "cpu":
        return f"quantized GEMMs run on CPU only (device {device.type})"
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16):
        return f"quantized GEMMs take float32 or bfloat16 activations, not {dtype}"
    if kernels is None:
        return "the C++ CPU kernels are off"
    if deterministic:
        return "--deterministic (the quantized GEMM picks its kernel by row count)"
    return None


def _gguf_method(
    path: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    kernels: object | None,
    deterministic: bool,
    shard: TPShard | None = None,
) -> GGUFLinearMethod | None:
    """The quantized method for a GGUF file, or None (logged why: the dequantized
    conversion is served instead)."""
    why = stored_gguf_refusal(
        sharded=shard is not None,
        device=device,
        dtype=dtype,
        kernels=kernels,
        deterministic=deterministic,
    )
    if why is None:
        try:
            return GGUFLinearMethod(GGUFWeights(path, cfg, family_named(cfg.family).names), kernels)
        except ModelLoadError as exc:
            why = str(exc)
    log.info("GGUF %s: serving dequantized weights (%s)", path.name, why)
    return None


def bf16_float32_gemm(dtype: torch.dtype) -> bool:
    """bf16 on a CPU without bf16 math multiplies float32 copies of the weights (see
    `PackedLinear`); ``MSTAR_CPU_BF16_FLOAT32_GEMM=0`` keeps only the bf16 weights: less
    weight memory, linears 1.4x slower at 2 rows and 3.6x / 4.3x at 32 / 64."""
    if dtype != torch.bfloat16 or cpu_has_bf16():
        return False
    return os.environ.get("MSTAR_CPU_BF16_FLOAT32_GEMM", "1") != "0"
