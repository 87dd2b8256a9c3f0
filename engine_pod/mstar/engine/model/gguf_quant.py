"""A GGUF file's tensors as stored: quantized weights kept in their blocks, for `QuantLinear`.

`gguf_convert` dequantizes every tensor to float32 for a Hugging Face folder; this reader hands
each tensor over as the file holds it (``gguf.GGUFReader``'s raw block bytes, one row of whole
blocks per output), under the same Hugging Face names (`gguf_convert`'s name map). Llama's Q and
K rows are un-permuted here too (llama.cpp interleaves RoPE pairs): a quantized row is a whole
run of blocks, so moving rows is exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from mstar.engine.model.config import ModelLoadError
from mstar.engine.model.gguf_convert import (
    _HF_ARCH,
    _field,
    _hf_name,
    _unpermute,
    stored_plus_one,
)

#: types whose data are plain values (numpy's dtype), not blocks
PLAIN = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as the file stores it.

    ``shape``: the logical shape in numpy order ([out_features, in_features] for a matrix).
    ``data``: plain types: the values, of that shape (BF16: uint16 bits, as gguf reads them);
    block types: uint8 [shape[0], bytes per row] (2-D tensors; the blocks of the last dim).
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def quantized(self) -> bool:
        return self.qtype not in PLAIN


def read_stored(path: str | Path) -> Iterator[StoredTensor]:
    """Every tensor of a GGUF file (an architecture `gguf_convert` converts) that the model
    uses, as stored, with its Hugging Face name. ``data`` views the file (read-only memory map)
    except where Q/K rows were un-permuted or a ``1 + w`` norm shifted (copies)."""
    reader = GGUFReader(str(path))
    arch = str(_field(reader, "general.architecture"))
    if arch not in _HF_ARCH:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_HF_ARCH)}"
        )
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        if name is None:
            continue
        qtype = GGMLQuantizationType(t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))
        data: Any = t.data
        if qtype in PLAIN:
            data = data.reshape(shape)
            if stored_plus_one(arch, t.name):
                data = data - 1
        else:
            data = data.reshape(shape[0] if len(shape) > 1 else 1, -1)
        if arch == "llama" and t.name.endswith("attn_q.weight"):
            data = np.ascontiguousarray(_unpermute(data, heads))
        elif arch == "llama" and t.name.endswith("attn_k.weight"):
            data = np.ascontiguousarray(_unpermute(data, kv_heads))
        yield StoredTensor(name, qtype, shape, data)
