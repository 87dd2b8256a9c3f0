"""The decoder against transformers on tiny random Llama and Qwen2 checkpoints.

Each checkpoint is written by transformers' own ``save_pretrained`` plus a small word-level
tokenizer, loaded with ``load_model``, and driven through real paged attention: full prefill,
chunked prefill batched with other sequences (mixed prefill + decode in one flat batch), and
decode steps, each logit compared with transformers' forward over the whole sequence.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from external_tools import require_tool
from mstar_model_testutil import PagedPool
from tiny_checkpoints import LLAMA3_SCALING, VOCAB, hf_logits, make_checkpoint, write_tokenizer

from mstar.engine.model import ModelConfig, ModelLoadError, load_model
from mstar.kernels import cpu_gemm, cpu_isa, cpu_kernels

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "family,kwargs",
    [
        ("llama", {}),
        ("qwen2", {}),
        ("llama", {"rope_scaling": LLAMA3_SCALING}),
        ("llama", {"tie": True, "shard": True}),
    ],
    ids=["llama", "qwen2", "llama3-rope", "tied-sharded"],
)
def test_full_prefill_matches_transformers(tmp_path, family, kwargs):
    hf = make_checkpoint(tmp_path, family, **kwargs)
    if kwargs.get("shard"):
        assert (tmp_path / "model.safetensors.index.json").is_file()
    decoder, cfg, _ = load_model(tmp_path, "float32")
    assert cfg.family == family
    ids = random.Random(1).choices(range(VOCAB), k=45)
    pool = PagedPool(cfg, num_pages=32, page_size=4)
    ours = pool.step(decoder, [(0, ids)], all_logits=True)
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("level", sorted({cpu_isa.best_level(cpu_isa.detect()).name, "x86-64-v3"}))
def test_cpu_kernels_run_float32_and_can_be_switched_off(tmp_path, monkeypatch, level):
    """A CPU float32 load takes the C++ glue kernels (add + RMSNorm, RoPE), at this CPU's level
    and at AVX2's; with MSTAR_CPU_KERNELS=0 it keeps torch's ops. All match transformers, decode
    rows included."""
    require_tool("g++")
    require_tool("ninja")
    if level not in [lvl.name for lvl in cpu_isa.supported_levels()]:
        pytest.skip(f"this CPU does not run {level}")
    monkeypatch.setenv(cpu_isa.ENV_LEVEL, level)
    hf = make_checkpoint(tmp_path, "llama")
    ids = random.Random(4).choices(range(VOCAB), k=30)
    ref = hf_logits(hf, ids)

    def run() -> tuple[object, torch.Tensor]:
        decoder, cfg, _ = load_model(tmp_path, "float32")
        pool = PagedPool(cfg, num_pages=32, page_size=4)
        first = pool.step(decoder, [(0, ids[:20])], all_logits=True)
        rest = [pool.step(decoder, [(0, [tok])], all_logits=True) for tok in ids[20:]]
        return decoder.cpu_kernels, torch.cat([first, *rest])

    cpu_kernels.load.cache_clear()
    kernels, with_kernels = run()
    assert kernels is not None and kernels.isa_level() == level
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    cpu_kernels.load.cache_clear()
    try:
        kernels, without = run()
    finally:
        cpu_kernels.load.cache_clear()
    assert kernels is None
    torch.testing.assert_close(with_kernels, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(without, ref, atol=1e-5, rtol=1e-5)


def test_last_layer_runs_only_the_sampled_rows_with_the_same_numbers(tmp_path, monkeypatch):
    """Sampling only each sequence's last row prunes the last layer to those rows after its
    attention: their logits equal the all-rows run's, and every row's K/V is still written, so
    the next decode step matches too (and transformers). One GEMM kernel for every row count
    (on Intel, float32 batches under 8 rows would take MKL's, rounded differently)."""
    monkeypatch.setattr(cpu_gemm, "float32_packed_min_rows", lambda features=None: 0)
    hf = make_checkpoint(tmp_path, "llama")
    decoder, cfg, _ = load_model(tmp_path, "float32")
    rng = random.Random(6)
    a, b = rng.choices(range(VOCAB), k=17), rng.choices(range(VOCAB), k=9)
    full = PagedPool(cfg, num_pages=32, page_size=4)
    pruned = PagedPool(cfg, num_pages=32, page_size=4)
    every = full.step(decoder, [(0, a), (1, b)], all_logits=True)
    last = pruned.step(decoder, [(0, a), (1, b)])
    assert last.shape[0] == 2
    torch.testing.assert_close(last, every[[len(a) - 1, len(a) + len(b) - 1]], atol=0, rtol=0)
    torch.testing.assert_close(pruned.kv, full.kv, atol=0, rtol=0)
    nxt = pruned.step(decoder, [(0, [7]), (1, [9])])
    torch.testing.assert_close(nxt[0], hf_logits(hf, [*a, 7])[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nxt[1], hf_logits(hf, [*b, 9])[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "family,kwargs",
    [("llama", {}), ("qwen2", {}), ("llama", {"rope_scaling": LLAMA3_SCALING})],
    ids=["llama", "qwen2", "llama3-rope"],
)
def test_chunked_prefill_and_decode_in_mixed_batches(tmp_path, family, kwargs):
    """Seq A: 2 prefill chunks then 8 decodes; B and C join and leave at other times."""
    hf = make_checkpoint(tmp_path, family, **kwargs)
    decoder, cfg, _ = load_model(tmp_path, "float32")
    rng = random.Random(2)
    prompts = {
        "A": rng.choices(range(VOCAB), k=13),
        "B": rng.choices(range(VOCAB), k=5),
        "C": rng.choices(range(VOCAB), k=22),
    }
    seq_ids = {"A": 0, "B": 1, "C": 2}
    history = {k: [] for k in prompts}  # tokens fed so far
    logits = {k: [] for k in prompts}  # our logits per fed position
    pool = PagedPool(cfg, num_pages=40, page_size=4, seed=3)

    def step(batch):
        flat = [(seq_ids[name], toks) for name, toks in batch]
        out = pool.step(decoder, flat, all_logits=True)
        row = 0
        for name, toks in batch:
            history[name].extend(toks)
            logits[name].append(out[row : row + len(toks)])
            row += len(toks)

    step([("A", prompts["A"][:7]), ("C", prompts["C"])])  # A chunk 1 + C full prefill
    step([("C", [5]), ("A", prompts["A"][7:]), ("B", prompts["B"])])  # decode + chunk 2 + new
    for i in range(8):  # decode steps; B finishes early, the others continue
        batch = [("A", [(3 * i + 1) % VOCAB]), ("C", [(7 * i + 2) % VOCAB])]
        if i < 4:
            batch.insert(1, ("B", [(11 * i + 3) % VOCAB]))
        step(batch)
    for name in prompts:
        ours = torch.cat(logits[name])
        ref = hf_logits(hf, history[name])
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5, msg=f"sequence {name}")
    assert len(history["A"]) == 13 + 8


def test_llama3_rope_scaling_is_applied(tmp_path):
    """The scaled model must differ from the unscaled one past the original context."""
    make_checkpoint(tmp_path, "llama", rope_scaling=LLAMA3_SCALING)
    _, cfg, _ = load_model(tmp_path)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "llama3"
    assert cfg.rope_scaling.factor == 8.0
    plain = ModelConfig.from_dict({**cfg.raw, "rope_parameters": {"rope_theta": 10000.0}})
    assert plain.rope_scaling is None


def test_tokenizer_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    make_checkpoint(tmp_path, "llama")
    _, _, tok = load_model(tmp_path)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "w1 w2 w77 <|im_end|> w3"
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(tok.encode(text)) == "w1 w2 w77 w3"
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.eos_token_ids == [2]
    assert tok.bos_token_id == 1
    assert tok.vocab_size == VOCAB
    msgs = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]
    for gen in (True, False):
        assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == (
            hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        )


def test_chat_template_from_jinja_file(tmp_path):
    make_checkpoint(tmp_path, "llama")
    write_tokenizer(tmp_path, template_in_jinja_file=True)
    _, _, tok = load_model(tmp_path)
    rendered = tok.apply_chat_template([{"role": "user", "content": "w5"}])
    assert rendered == "<|im_start|>user\nw5<|im_end|>\n<|im_start|>assistant\n"


# --- failures name the problem ---------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(f)


def test_missing_config(tmp_path):
    make_checkpoint(tmp_path, "llama")
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing config\.json"):
        load_model(tmp_path)


def test_missing_weights(tmp_path):
    make_checkpoint(tmp_path, "llama")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"missing weights.*safetensors"):
        load_model(tmp_path)


def test_missing_shard(tmp_path):
    make_checkpoint(tmp_path, "llama", shard=True)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(ModelLoadError, match=f"missing weight shard {shard}"):
        load_model(tmp_path)


def test_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    make_checkpoint(tmp_path, "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


def test_missing_tokenizer(tmp_path):
    make_checkpoint(tmp_path, "llama")
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing tokenizer\.json"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path):
    make_checkpoint(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture GPT2LMHeadModel"):
        load_model(tmp_path)


def test_unsupported_rope_type():
    with pytest.raises(ModelLoadError, match="unsupported rope_scaling type 'dynamic'"):
        ModelConfig.from_dict(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 8,
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 8,
                "rope_scaling": {"rope_type": "dynamic", "factor": 4.0},
            }
        )


def test_bad_dtype(tmp_path):
    make_checkpoint(tmp_path, "llama")
    with pytest.raises(ModelLoadError, match="unsupported dtype 'int8'"):
        load_model(tmp_path, "int8")


def test_config_fields_llama_and_qwen2_v4_style():
    """transformers 4.x style (top-level rope_theta/rope_scaling) parses too."""
    llama = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
            "bos_token_id": 7,
            "eos_token_id": [8, 9],
            "rope_scaling": LLAMA3_SCALING,
        }
    )
    assert (llama.head_dim, llama.num_kv_heads, llama.rope_theta) == (8, 2, 500000.0)
    assert llama.eos_token_ids == (8, 9) and llama.bos_token_id == 7
    assert llama.tie_word_embeddings and not llama.qkv_bias
    assert (
        llama.rope_scaling is not None and llama.rope_scaling.original_max_position_embeddings == 16
    )
    qwen = ModelConfig.from_dict(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "head_dim": 16,
        }
    )
    assert qwen.qkv_bias and not qwen.o_bias and qwen.head_dim == 16
