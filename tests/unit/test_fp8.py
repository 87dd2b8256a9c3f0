"""FP8 weights through the linear seam (`model.fp8`), on CPU.

Checkpoints are written in the two layouts vLLM reads, from a tiny random Llama: ``fp8``
(per-tensor float32 ``weight_scale`` scalars, one per checkpoint weight, optionally a static
``input_scale``) and ``compressed-tensors`` float-quantized (per-channel ``weight_scale``
[N, 1]). Greedy decoding in float32 equals transformers on the same model whose weights are the
dequantized FP8 values, token for token; the FP8 GEMM path (per-token activation scales, then
``torch._scaled_mm``, what CUDA runs) is checked against the dequantized reference on CPU
tensors within FP8's rounding.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import hf_greedy
from safetensors.torch import load_file, save_file

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.model.config import ModelLoadError
from mstar.engine.model.fp8 import FP8, Fp8Linear, quantize_activations, quantize_rows
from mstar.engine.model.linear import LinearSpec
from mstar.engine.model.loader import load_model
from mstar.engine.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48], [9]]
NEW = 10
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic"}
CT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                        "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "symmetric": True, "dynamic": True},
        }
    },
    "ignore": ["lm_head"],
}  # fmt: skip


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJ


def _write_variant(src: Path, dst: Path, quant_config: dict | None, per_channel: bool,
                   static_input: bool = False) -> None:  # fmt: skip
    """``dst``: ``src``'s model, FP8 in the layout ``quant_config`` names (None: the
    dequantized float32 reference, same tokenizer)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not _is_projection(name):
            out[name] = w
            continue
        if per_channel:
            q, scale = quantize_rows(w)
            stored_scale = scale[:, None].contiguous()  # compressed-tensors: [N, 1]
        else:
            scale = (w.abs().max().float() / 448.0).reshape(())
            q = (w / scale).clamp(-448, 448).to(FP8)
            stored_scale = scale  # vLLM's fp8 layout: one float32 scalar per tensor
        base = name.rpartition(".")[0]
        if quant_config is None:
            out[name] = (q.float() * scale.reshape(-1, 1)).contiguous()
            continue
        out[name] = q
        out[base + ".weight_scale"] = stored_scale
        if static_input:
            out[base + ".input_scale"] = torch.tensor(0.02, dtype=torch.float32)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if quant_config is not None:
        cfg["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def folders(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    made = {
        "fp8": (FP8_CONFIG, False, False),
        "fp8-ref": (None, False, False),
        "ct": (CT_CONFIG, True, False),
        "ct-ref": (None, True, False),
        "fp8-static": ({**FP8_CONFIG, "activation_scheme": "static"}, False, True),
    }
    for name, (qc, per_channel, static) in made.items():
        _write_variant(tiny_llama_dir, root / name, qc, per_channel, static)
    return {name: root / name for name in made}


def _engine(folder: Path, quantization: str = "auto") -> LLMEngine:
    cfg = EngineConfig(model=str(folder), dtype="float32", device="cpu", num_pages=64,
                       quantization=quantization)  # fmt: skip
    return LLMEngine.from_config(cfg)


def _greedy(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    return engine.generate(PROMPTS, params)


@pytest.mark.parametrize("layout", ["fp8", "ct"])
def test_fp8_checkpoint_decodes_like_its_dequantized_weights(
    folders: dict[str, Path], layout: str
) -> None:
    engine = _engine(folders[layout])
    linears = [m for m in engine.decoder.modules() if isinstance(m, Fp8Linear)]
    assert len(linears) == 4 * engine.model_config.num_layers
    assert all(m.weight.dtype == FP8 for m in linears)
    assert not isinstance(engine.decoder.lm_head, Fp8Linear)
    assert _greedy(engine) == hf_greedy(folders[layout + "-ref"], PROMPTS, NEW)


def test_quantization_none_dequantizes_an_fp8_checkpoint_at_load(
    folders: dict[str, Path],
) -> None:
    engine = _engine(folders["fp8"], quantization="none")
    assert not any(isinstance(m, Fp8Linear) for m in engine.decoder.modules())
    assert _greedy(engine) == hf_greedy(folders["fp8-ref"], PROMPTS, NEW)


def test_quantization_fp8_quantizes_a_float_model_per_channel_at_load(
    tiny_llama_dir: Path, folders: dict[str, Path]
) -> None:
    engine = _engine(tiny_llama_dir, quantization="fp8")
    first = engine.decoder.layers[0].qkv_proj
    assert isinstance(first, Fp8Linear) and first.weight.dtype == FP8
    # the per-channel quantization at load is the one the compressed-tensors variant stored
    assert _greedy(engine) == hf_greedy(folders["ct-ref"], PROMPTS, NEW)


def test_static_input_scale_is_loaded_per_projection(folders: dict[str, Path]) -> None:
    decoder, _, _ = load_model(folders["fp8-static"], "float32", "cpu")
    qkv = decoder.layers[0].qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.input_scale is not None
    assert float(qkv.input_scale) == pytest.approx(0.02)
    # q, k, v keep their own per-tensor scales, row by row
    q_rows = decoder.config.num_heads * decoder.config.head_dim
    assert qkv.weight_scale[0] == qkv.weight_scale[q_rows - 1]
    assert not torch.equal(qkv.weight_scale[:q_rows].unique(), qkv.weight_scale.unique())


def _linear(n: int = 48, k: int = 64, bias: bool = True) -> tuple[Fp8Linear, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen)
    mod = Fp8Linear(LinearSpec("layers.0.o_proj", k, n, bias), torch.float32, torch.device("cpu"))
    q, s = quantize_rows(w)
    mod.weight.data.copy_(q)
    mod.weight_scale.data.copy_(s)
    if mod.bias is not None:
        mod.bias.data.copy_(torch.randn(n, generator=gen))
    return mod, torch.randn(5, k, generator=gen) * 3


def test_reference_path_is_the_dequantized_matmul() -> None:
    mod, x = _linear()
    deq = mod.weight.float() * mod.weight_scale[:, None]
    assert mod.bias is not None
    assert torch.equal(mod(x), torch.nn.functional.linear(x, deq, mod.bias))
    # and within FP8's rounding of the float weights it came from
    assert (deq - mod.dequantized(torch.float32)).abs().max() == 0


@pytest.mark.parametrize("static", [False, True])
def test_fp8_gemm_path_matches_the_dequantized_reference(static: bool) -> None:
    """The path CUDA runs (activations quantized per token or by a static scale, then
    ``torch._scaled_mm`` with row-wise scales), on CPU tensors: within e4m3's 2^-4."""
    mod, x = _linear()
    want = mod(x)
    mod.fp8_gemm = True
    if static:
        mod.input_scale = (x.abs().max() / 448.0).float()
    got = mod(x)
    err = (got - want).abs().max() / want.abs().max()
    assert 0 < err < 0.07


def _broken(folders: dict[str, Path], tmp_path: Path, qc: dict) -> Path:
    dst = tmp_path / "broken"
    shutil.copytree(folders["fp8"], dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    ("qc", "named"),
    [
        ({**FP8_CONFIG, "weight_block_size": [128, 128]}, "weight_block_size"),
        ({"quant_method": "awq"}, "quant_method"),
        ({**FP8_CONFIG, "activation_scheme": "mixed"}, "activation_scheme"),
        (
            {**CT_CONFIG, "config_groups": {"g": {"weights": {
                "num_bits": 8, "type": "float", "strategy": "block"}}}},
            "config_groups.g.weights.strategy",
        ),
        (
            {**CT_CONFIG, "config_groups": {"g": {"weights": {
                "num_bits": 4, "type": "int", "strategy": "channel"}}}},
            "config_groups.g.weights.type/num_bits",
        ),
    ],
)  # fmt: skip
def test_unserved_fp8_layouts_are_refused_by_name(
    folders: dict[str, Path], tmp_path: Path, qc: dict, named: str
) -> None:
    with pytest.raises(ModelLoadError, match=re.escape(f"quantization_config.{named}")):
        load_model(_broken(folders, tmp_path, qc), "float32", "cpu")


def test_a_missing_scale_is_named(folders: dict[str, Path], tmp_path: Path) -> None:
    dst = _broken(folders, tmp_path, FP8_CONFIG)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_scale"):
        load_model(dst, "float32", "cpu")


def _check_triton_quantizer() -> None:
    """Run in a fresh interpreter with ``TRITON_INTERPRET=1`` (see the test below)."""
    from mstar.kernels import fp8_quant

    quantize = fp8_quant.load()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 8, 200, generator=gen)[:, 0, :] * 3  # rows strided, as views arrive
    x[4] = 0  # an all-zero row takes the smallest scale, not a division by zero
    for static in (None, torch.tensor(0.04)):
        for dtype in (torch.float32, torch.bfloat16):
            got_q, got_s = quantize(x.to(dtype), static)
            want_q, want_s = quantize_activations(x.to(dtype), static)
            assert torch.equal(got_s, want_s)
            want = want_q.float()
            kept = want.abs().log2() != want.abs().log2().round()  # not a power of two
            # within one e4m3 step (3 mantissa bits) of the reference: the interpreter breaks
            # ties away from zero where the GPU and torch round them to even
            err = (got_q.float() - want).abs()
            assert (err[kept] <= want.abs()[kept] / 8).all()
            assert (err[kept] == 0).float().mean() > 0.95 and kept.float().mean() > 0.6
            assert not got_q.float()[4].any()


def test_triton_quantizer_matches_the_torch_quantizer_under_the_interpreter() -> None:
    """`fp8_quant`'s one-kernel quantizer (what CUDA runs) computes the torch reference's
    scales, and its e4m3 values as far as Triton's CPU interpreter casts like the GPU: the
    interpreter drops the carry when a value rounds up into the next power of two (126.5 ->
    64, not 128) and breaks ties away from zero (tests/gpu checks the values exactly on the
    device). In a subprocess: the interpreter must be on before Triton is first imported."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([*sys.path, env.get("PYTHONPATH", "")])
    code = "import test_fp8; test_fp8._check_triton_quantizer()"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).parent,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_quantization_fp8_flag_round_trips_and_refuses_tensor_parallelism() -> None:
    import argparse

    from mstar.engine.config import add_cli_args, from_namespace, to_cli_args

    cfg = EngineConfig(model="m", quantization="fp8")
    assert cfg.validate() == [] and "fp8" in to_cli_args(cfg)
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert from_namespace(parser.parse_args(to_cli_args(cfg))) == cfg
    with pytest.raises(ValueError, match="--quantization fp8: not served with --tensor-par"):
        EngineConfig(model="m", quantization="fp8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--quantization must be one of auto, none, fp8"):
        EngineConfig(quantization="int4")


def test_a_fused_projection_mixing_fp8_and_float_parts_is_named(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    dst = _broken(folders, tmp_path, FP8_CONFIG)
    tensors = load_file(str(dst / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = tensors[name].float()
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"layers\.0\.qkv_proj: its tensors mix FP8"):
        load_model(dst, "float32", "cpu")
