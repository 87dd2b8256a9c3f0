"""`gguf_quant.read_stored`: a GGUF file's tensors as stored, under their Hugging Face names.

A tiny Llama (and Gemma 3) file mixes what real ones hold (Q8_0, Q4_1, Q4_K, Q6_K matrices,
F32 norms); each stored tensor, dequantized by the ``gguf`` package, must equal what
`gguf_convert` (the float32 conversion) reads from the same file, so the Q/K rows un-permuted as
raw blocks land where the converter puts the float rows.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from test_model_gguf_convert import write_tiny_gguf
from test_quant_linear import make_blocks

from mstar.engine.model.config import ModelLoadError
from mstar.engine.model.gguf_convert import _read_tensors
from mstar.engine.model.gguf_quant import read_stored, scan

HEADS, KV_HEADS, HIDDEN, INTER = 4, 2, 256, 512


def write_gguf(path: Path, arch: str = "llama") -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(1)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)

    def matrix(name: str, rows: int, cols: int, qtype: str) -> None:
        if qtype in ("Q4_K", "Q6_K"):  # gguf cannot quantize these: random valid blocks
            raw = make_blocks(qtype, rows, cols, seed=rows)
        else:
            raw = quantize(
                rng.standard_normal((rows, cols), dtype=np.float32), GGMLQuantizationType[qtype]
            )
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[qtype])

    kv = KV_HEADS * HIDDEN // HEADS
    matrix("blk.0.attn_q.weight", HIDDEN, HIDDEN, "Q8_0")
    matrix("blk.0.attn_k.weight", kv, HIDDEN, "Q4_1")
    matrix("blk.0.attn_v.weight", kv, HIDDEN, "Q6_K")
    matrix("blk.0.ffn_down.weight", HIDDEN, INTER, "Q4_K")
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(HIDDEN, dtype=np.float32))
    w.add_tensor("rope_freqs", np.ones(8, dtype=np.float32))  # not a model weight: skipped
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_stored_tensors_dequantize_to_the_converted_ones(tmp_path, arch):
    """Gemma's norm (stored ``1 + w``) comes back as the converter's ``w``; its Q/K rows stay."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path, arch)
    converted = _read_tensors(gguf.GGUFReader(str(path)), arch, HEADS, KV_HEADS)
    stored = {t.name: t for t in read_stored(path)}
    assert set(stored) == set(converted)
    types = {name: t.qtype.name for name, t in stored.items()}
    assert types == {
        "model.layers.0.self_attn.q_proj.weight": "Q8_0",
        "model.layers.0.self_attn.k_proj.weight": "Q4_1",
        "model.layers.0.self_attn.v_proj.weight": "Q6_K",
        "model.layers.0.mlp.down_proj.weight": "Q4_K",
        "model.layers.0.input_layernorm.weight": "F32",
    }
    for name, t in stored.items():
        assert t.shape == tuple(converted[name].shape)
        if t.quantized:
            assert t.data.dtype == np.uint8 and t.data.shape[0] == t.shape[0]
            values = np.asarray(dequantize(t.data, t.qtype), dtype=np.float32)
        else:
            values = t.data
        assert np.array_equal(values, converted[name].numpy()), name


def test_other_architectures_are_refused(tmp_path):
    write_gguf(tmp_path / "x.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError, match="gpt2"):
        list(read_stored(tmp_path / "x.gguf"))


def test_scan_reads_what_gguf_reader_reads(tmp_path):
    """`scan` skips the metadata arrays (vocabulary, merges, token types) by their lengths and
    lands on the same tensors, bytes and scalar fields as ``gguf.GGUFReader``."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2", qtypes={"attn_q.weight": "Q8_0", "ffn_up.weight": "Q4_1"})
    fields, tensors = scan(path)
    reader = gguf.GGUFReader(str(path))
    assert [t[0] for t in tensors] == [t.name for t in reader.tensors]
    for (_, qtype, shape, raw), t in zip(tensors, reader.tensors, strict=True):
        assert qtype == t.tensor_type and shape == tuple(int(d) for d in reversed(t.shape))
        assert raw.tobytes() == np.ascontiguousarray(t.data).tobytes(), t.name
    scalars = {
        k: f.contents()
        for k, f in reader.fields.items()
        if not k.startswith("GGUF.") and f.types[0] != gguf.GGUFValueType.ARRAY
    }
    assert fields.keys() == scalars.keys()
    for key, value in scalars.items():
        assert fields[key] == pytest.approx(value), key
