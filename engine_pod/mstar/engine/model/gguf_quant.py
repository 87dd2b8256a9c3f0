"""A GGUF file's tensors as stored: quantized weights kept in their blocks, for `QuantLinear`.

`gguf_convert` dequantizes every tensor to float32 for a Hugging Face folder; this reader hands
each tensor over as the file holds it (its raw block bytes, one row of whole blocks per output,
read by `scan`), under the same Hugging Face names (`gguf_convert`'s name map, per architecture:
Llama, Qwen2, Qwen3, Gemma 3). Llama's Q and K rows are un-permuted here too (llama.cpp
interleaves RoPE pairs): a quantized row is a whole run of blocks, so moving rows is exact.
Gemma's norms (stored ``1 + w``, F32) come back as ``w``, as `gguf_convert` writes them.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from mstar.engine.model.config import ModelLoadError
from mstar.engine.model.gguf_convert import (
    _HF_ARCH,
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
    fields, tensors = scan(path)
    arch = str(fields.get("general.architecture"))
    if arch not in _HF_ARCH:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_HF_ARCH)}"
        )
    heads = int(fields[f"{arch}.attention.head_count"])
    kv_heads = int(fields.get(f"{arch}.attention.head_count_kv", heads))
    for gguf_name, qtype, shape, raw in tensors:
        name = _hf_name(gguf_name, arch)
        if name is None:
            continue
        data: Any
        if qtype in PLAIN:
            data = raw.view(_PLAIN_DTYPES[qtype]).reshape(shape)
            if stored_plus_one(arch, gguf_name):
                data = data - 1
        else:
            data = raw.reshape(shape[0] if len(shape) > 1 else 1, -1)
        if arch == "llama" and gguf_name.endswith("attn_q.weight"):
            data = np.ascontiguousarray(_unpermute(data, heads))
        elif arch == "llama" and gguf_name.endswith("attn_k.weight"):
            data = np.ascontiguousarray(_unpermute(data, kv_heads))
        yield StoredTensor(name, qtype, shape, data)


#: GGUF metadata value types (``gguf.GGUFValueType``) of fixed size -> struct format
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                   11: "q", 12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.BF16: np.uint16,  # bits, as gguf reads them
}


def scan(
    path: str | Path,
) -> tuple[dict[str, Any], list[tuple[str, GGMLQuantizationType, tuple[int, ...], np.ndarray]]]:
    """A GGUF file's scalar metadata and its tensors (name, type, numpy-order shape, raw
    bytes viewing a read-only memory map).

    ``gguf.GGUFReader`` builds a numpy view per metadata item: 15 s for Gemma 3's 262k-piece
    vocabulary on the 2-core host, at every start. Serving needs only the tensors and a few
    scalars, so arrays are skipped here (strings by their lengths) and nothing is copied.
    """
    mm = np.memmap(str(path), dtype=np.uint8, mode="r")
    buf = memoryview(mm)  # type: ignore[arg-type]
    if bytes(buf[:4]) != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 or later)")
    pos = 24

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

    def skip(kind: int, at: int, count: int) -> int:
        if kind in _SCALAR_FORMATS:
            return at + count * struct.calcsize("<" + _SCALAR_FORMATS[kind])
        for _ in range(count):
            if kind == _STRING:
                at += 8 + struct.unpack_from("<Q", buf, at)[0]
            elif kind == _ARRAY:
                inner, n = struct.unpack_from("<IQ", buf, at)
                at = skip(inner, at + 12, n)
            else:
                raise ModelLoadError(f"{path}: unknown GGUF metadata type {kind}")
        return at

    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if kind in _SCALAR_FORMATS:
            (fields[key],) = struct.unpack_from("<" + _SCALAR_FORMATS[kind], buf, pos)
        elif kind == _STRING:
            fields[key], _ = string(pos)
        pos = skip(kind, pos, 1)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, GGMLQuantizationType(qtype), tuple(reversed(dims)), offset))
    align = int(fields.get("general.alignment", 32))
    start = -(-pos // align) * align
    tensors = []
    for name, qtype, shape, offset in infos:
        block, size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * size
        raw = mm[start + offset : start + offset + nbytes]
        tensors.append((name, qtype, tuple(int(d) for d in shape), np.asarray(raw)))
    return fields, tensors
