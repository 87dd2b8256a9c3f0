"""The decoder against transformers on tiny random Llama and Qwen2 checkpoints.

Each checkpoint is written by transformers' own ``save_pretrained`` plus a small word-level
tokenizer, loaded with ``load_model``, and driven through real paged attention: full prefill,
chunked prefill batched with other sequences (mixed prefill + decode in one flat batch), and
decode steps, each logit compared with transformers' forward over the whole sequence.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from external_tools import require_tool
from mstar_model_testutil import PagedPool
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from mstar.engine.model import ModelConfig, ModelLoadError, load_model, loader
from mstar.kernels import cpu_gemm, cpu_isa, cpu_kernels
from mstar.kernels.cpu_gemm import (
    AMX_MAX_ROWS,
    BF16_FLOAT32_GEMM_MIN_ROWS,
    DPBF16_MAX_ROWS,
    FMA_MAX_ROWS,
    INTEL_FLOAT32_PACKED_MIN_ROWS,
    PackedLinear,
    float32_packed_min_rows,
    small_batch_kernel,
)

VOCAB = 128
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


pytestmark = pytest.mark.usefixtures("one_thread")


def write_tokenizer(folder: Path, template_in_jinja_file: bool = False) -> None:
    words = SPECIALS + [f"w{i}" for i in range(VOCAB - len(SPECIALS))]
    tok = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    tcfg = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if template_in_jinja_file:
        (folder / "chat_template.jinja").write_text(TEMPLATE)
    else:
        tcfg["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg))


def make_checkpoint(
    folder: Path, family: str, *, rope_scaling=None, tie=False, shard=False, seed=0
) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    if family == "llama":
        cfg = LlamaConfig(**common, rope_theta=10000.0, rope_scaling=rope_scaling)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**common, rope_theta=10000.0)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # biases init to zero; make them matter
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.3)
    with torch.no_grad():  # RMSNorm weights init to one; make them matter too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.eval()
    model.save_pretrained(folder, max_shard_size="40KB" if shard else "1GB")
    write_tokenizer(folder)
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


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


@pytest.mark.parametrize("native_bf16", [True, False])
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: QKV bias through the packed path
def test_bfloat16_load_close_to_transformers(tmp_path, monkeypatch, family, native_bf16):
    """Both bf16 GEMM routes (oneDNN's bf16 kernel, float32 GEMMs on CPUs without bf16 math)."""
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: native_bf16)
    hf = make_checkpoint(tmp_path, family)
    decoder, cfg, _ = load_model(tmp_path, "bfloat16")
    assert decoder.dtype == torch.bfloat16
    # On CPU every bf16 projection and the LM head run on oneDNN-prepacked weights.
    qkv = decoder.layers[0].qkv_proj
    assert isinstance(qkv, PackedLinear) and isinstance(decoder.lm_head, PackedLinear)
    assert qkv.upcast is (not native_bf16) and decoder.lm_head.upcast is (not native_bf16)
    ids = random.Random(4).choices(range(VOCAB), k=20)
    pool = PagedPool(cfg, num_pages=16, page_size=4, dtype=torch.bfloat16)
    ours = pool.step(decoder, [(0, ids)], all_logits=True)
    assert ours.shape[0] == len(ids)
    hf_bf16 = hf.to(torch.bfloat16)
    torch.testing.assert_close(ours, hf_logits(hf_bf16, ids), atol=0.1, rtol=0.05)


def test_bf16_decode_sized_batches_take_the_small_batch_kernel(tmp_path):
    """Where the CPU has AMX tiles or AVX512-BF16, every bf16 projection keeps that kernel's
    packed weight too, and batches up to its row limit run it (bias included); larger ones
    oneDNN's kernel. Elsewhere no layer holds a second copy."""
    require_tool("g++")
    require_tool("ninja")
    make_checkpoint(tmp_path, "qwen2")  # QKV bias
    decoder, _, _ = load_model(tmp_path, "bfloat16")
    kernels = decoder.cpu_kernels
    assert kernels is not None
    layers = [decoder.lm_head, *(getattr(decoder.layers[0], n) for n in ("qkv_proj", "down_proj"))]
    assert all(isinstance(layer, PackedLinear) for layer in layers)
    kernel = small_batch_kernel(kernels)
    if kernel is None:
        assert all(layer.small_batch_weight is None for layer in layers)
        return
    linear, _, max_rows = kernel
    if kernels.amx_available():
        assert (max_rows, linear) == (AMX_MAX_ROWS, kernels.amx_linear)
    elif kernels.dpbf16_available():
        assert (max_rows, linear) == (DPBF16_MAX_ROWS, kernels.dpbf16_linear)
    else:
        assert (max_rows, linear) == (FMA_MAX_ROWS, kernels.fma_linear)
    gen = torch.Generator().manual_seed(3)
    for layer in layers:
        assert layer.small_batch_weight is not None
        for rows in (1, 17, max_rows, max_rows + 1):
            x = torch.randn(rows, layer.in_features, generator=gen).to(torch.bfloat16)
            if rows <= max_rows:
                want = linear(x, layer.small_batch_weight, layer.out_features, layer.bias)
            else:
                want = torch.ops.mkldnn._linear_pointwise(
                    x.float() if layer.upcast else x,
                    layer.packed_weight,
                    layer.float32_bias if layer.upcast else layer.bias,
                    "none",
                    [],
                    "",
                ).to(x.dtype)
            assert torch.equal(layer(x), want)


#: /proc/cpuinfo flags of a 2-core AMD EPYC of family 23 (Zen 1): AVX2, FMA, F16C, no AVX-512
ZEN1_CPUINFO = (
    "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2 movbe abm adx sha_ni "
    "xsave xsaveopt aes pclmulqdq rdrand rdseed clflushopt"
)
ZEN1_FLAGS = frozenset(ZEN1_CPUINFO.split())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bfloat16_on_an_avx2_cpu_never_asks_onednn_for_bf16(tmp_path, monkeypatch, family):
    """An AVX2-only CPU (its features substituted, the kernels' x86-64-v3 build): oneDNN has no
    bf16 GEMM there and raises on a bf16 weight, so bf16 layers keep the FMA kernel for
    decode-sized batches and float32 copies for the rest, and the model stays close to
    transformers in bf16."""
    require_tool("g++")
    require_tool("ninja")
    avx2 = cpu_isa.CpuFeatures(ZEN1_FLAGS, "AuthenticAMD")
    assert cpu_isa.best_level(avx2).name == "x86-64-v3" and not avx2.onednn_bf16
    monkeypatch.setattr(cpu_isa, "detect", lambda: avx2)
    monkeypatch.setenv(cpu_isa.ENV_LEVEL, "x86-64-v3")
    cpu_kernels.load.cache_clear()
    try:
        hf = make_checkpoint(tmp_path, family)
        decoder, cfg, _ = load_model(tmp_path, "bfloat16")
    finally:
        cpu_kernels.load.cache_clear()
    kernels = decoder.cpu_kernels
    assert kernels is not None and kernels.isa_level() == "x86-64-v3"
    for layer in (decoder.lm_head, decoder.layers[0].qkv_proj, decoder.layers[1].down_proj):
        assert isinstance(layer, PackedLinear) and layer.upcast
        assert layer.few_rows_weight is None and layer.packed_weight.dtype == torch.float32
        assert layer.small_batch_linear == kernels.fma_linear
        assert layer.small_batch_max_rows == FMA_MAX_ROWS
    ids = random.Random(4).choices(range(VOCAB), k=FMA_MAX_ROWS + 8)
    pool = PagedPool(cfg, num_pages=32, page_size=4, dtype=torch.bfloat16)
    prompt = pool.step(decoder, [(0, ids[:-1])], all_logits=True)  # float32 GEMMs (15 rows)
    last = pool.step(decoder, [(0, ids[-1:])], all_logits=True)  # the FMA kernel (1 row)
    hf_bf16 = hf.to(torch.bfloat16)
    ours = torch.cat([prompt, last])
    torch.testing.assert_close(ours, hf_logits(hf_bf16, ids), atol=0.1, rtol=0.05)


def test_bfloat16_float32_gemm_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: False)
    monkeypatch.setenv("MSTAR_CPU_BF16_FLOAT32_GEMM", "0")
    make_checkpoint(tmp_path, "llama")
    decoder, _, _ = load_model(tmp_path, "bfloat16")
    layer = decoder.layers[0].gate_up_proj
    assert isinstance(layer, PackedLinear) and not layer.upcast
    assert layer.packed_weight.dtype == torch.bfloat16


def test_bfloat16_float32_gemm_rounds_a_float32_product_to_bf16():
    """From BF16_FLOAT32_GEMM_MIN_ROWS rows: the float32 product of the exact bf16 values,
    rounded once to bf16; one row stays on oneDNN's bf16 kernel over the bf16 weight."""
    gen = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(64, 48, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=gen))
        linear.bias.copy_(torch.randn(48, generator=gen))
    layer = PackedLinear(linear, float32_gemm=True)
    assert layer.packed_weight.dtype == torch.float32
    many = torch.randn(BF16_FLOAT32_GEMM_MIN_ROWS * 8, 64, generator=gen).to(torch.bfloat16)
    got = layer(many)
    assert got.dtype == torch.bfloat16
    exact = many.double() @ linear.weight.detach().double().T + linear.bias.detach().double()
    # float32 accumulation, then one bf16 rounding: within one bf16 ulp of the exact product.
    torch.testing.assert_close(got.double(), exact, rtol=2**-7, atol=1e-4)
    one = many[:1]
    assert BF16_FLOAT32_GEMM_MIN_ROWS > 1
    bf16_kernel = torch.ops.mkldnn._linear_pointwise(
        one,
        torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None),
        linear.bias,
        "none",
        [],
        "",
    )
    assert torch.equal(layer(one), bf16_kernel)


def test_float32_packs_for_batches_and_keeps_plain_weights_for_few_rows(tmp_path):
    """float32 layers run MKL's F.linear below float32_packed_min_rows() rows (Intel), oneDNN
    from there; where that is 0 (MKL slow at few rows) every batch takes oneDNN, no plain copy."""
    make_checkpoint(tmp_path, "llama")
    decoder, cfg, _ = load_model(tmp_path)
    layer = decoder.layers[0].qkv_proj
    assert isinstance(layer, PackedLinear) and isinstance(decoder.lm_head, PackedLinear)
    gen = torch.Generator().manual_seed(0)
    min_rows = float32_packed_min_rows()
    few = torch.randn(max(min_rows - 1, 1), cfg.hidden_size, generator=gen)
    many = torch.randn(INTEL_FLOAT32_PACKED_MIN_ROWS * 4, cfg.hidden_size, generator=gen)
    for x in (few, many):
        packed = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, None, "none", [], "")
        if x.shape[0] < min_rows:
            assert layer.weight is not None and layer.weight.dtype == torch.float32
            assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
        else:
            assert torch.equal(layer(x), packed)
    if min_rows <= 1:
        assert layer.weight is None and layer.min_rows == 0


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
    with pytest.raises(ModelLoadError, match="unsupported rope_scaling type 'yarn'"):
        ModelConfig.from_dict(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 8,
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 8,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
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
