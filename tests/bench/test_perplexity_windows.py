"""bench/bench_perplexity.py scores what llama-perplexity scores: whole ``ctx`` windows (the tail
dropped, the first token BOS where the vocabulary adds one), each window's second half, through
the engine's prompt logprobs; on the tiny Llama the mean NLL equals transformers' log-softmax
over the same windows. Its table's census counts a file's matrices by type."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from bench.bench_perplexity import census, mstar_engine, mstar_nll, windows

CTX = 16


def test_windows_cut_as_llama_perplexity() -> None:
    tokens = list(range(2 * CTX + 5))
    wins = windows(tokens, CTX, bos=None)
    assert wins == [tokens[:CTX], tokens[CTX : 2 * CTX]]
    with_bos = windows(tokens, CTX, bos=1000)
    assert [w[0] for w in with_bos] == [1000, 1000]
    assert [w[1:] for w in with_bos] == [w[1:] for w in wins]


def test_engine_nll_is_transformers_on_the_scored_halves(tiny_llama_dir: Path) -> None:
    import transformers

    rng = random.Random(3)
    tokens = [rng.randrange(3, 90) for _ in range(3 * CTX + 7)]
    wins = windows(tokens, CTX, bos=1)
    engine = mstar_engine(tiny_llama_dir, "float32", "auto", CTX * len(wins))
    total, count = mstar_nll(engine, wins)
    assert count == len(wins) * (CTX - CTX // 2 - 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    want = 0.0
    with torch.inference_mode():
        for w in wins:
            logp = model(torch.tensor([w])).logits[0].float().log_softmax(-1)
            want -= sum(float(logp[p, w[p + 1]]) for p in range(CTX // 2, CTX - 1))
    assert total / count == pytest.approx(want / count, rel=1e-5)


def test_census_shares_the_matrices_weights_by_type(tmp_path: Path) -> None:
    """llama.cpp's fallback types show: 256 Q8_0 weights beside 128 F32 ones; 1-D tensors (norms)
    are not counted."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch="llama")
    q8 = quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("a.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("b.weight", rng.standard_normal((4, 32)).astype(np.float32))
    writer.add_tensor("norm.weight", rng.standard_normal(1000).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert census(tmp_path / "m.gguf") == "Q8_0 67%, F32 33%"
