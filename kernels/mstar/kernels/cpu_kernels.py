"""CPU kernels in C++ for a step: paged attention and the fused glue around the GEMMs.

- ``paged_decode``: decode attention reading K/V straight from the cache pages. The torch path
  gathers every page of every decode row into a padded head-major copy in every layer. This
  kernel walks each row's page table in place, one task per sequence on torch's own OpenMP team
  (``at::parallel_for``): scores for 16 keys at a time against every query head of a KV group,
  one transpose-and-add reduction per block instead of a horizontal sum per key, a vectorised
  softmax, values weighed with the group's accumulators in registers. float32 and bfloat16
  caches; bf16 loads widen to float32 and the output rounds back once.
- ``paged_prefill``: causal attention for a step's prompt chunks over the same pages, fresh
  prompts and chunks after cached keys alike (torch's SDPA, run per sequence on a gathered
  copy, took 2x as long for a 140-token prompt with SmolLM2's heads). bf16 on AMX: 16 query
  rows per tile, Q.K^T and P.V as tile products (P rounded to bf16 first, as FlashAttention
  does); SmolLM2's heads, 16 prompts of 128 tokens, per layer: 3.05 -> 1.24 ms, one 2,048-token
  prompt 34.8 -> 12.2 ms (2-core Xeon). Elsewhere vectors; every level masks the softmax's last
  partial vector instead of a scalar exp per key past it (16 x 128: 3.12 -> 2.61 ms on the
  AVX512-BF16 build, 3.77 -> 3.54 on AVX2).
- ``write_kv``: a step's new K/V rows into a layer's pages, one copy per token (the torch path
  computes slot rows and runs two ``index_copy_`` per layer).
- ``add_rms_norm_``: the residual add and HF's RMSNorm in one pass (float32 or bf16, rounded
  to bf16 where torch's ops round).
- ``rope_``: rotate_half RoPE on Q and K in place (float32 or bf16), bit-identical to the torch
  ops (bf16 denormals aside: where the CPU has AVX512-BF16, one VCVTNEPS2BF16 rounds to bf16,
  and it flushes them to zero).
- ``silu_mul`` / ``gelu_tanh_mul``: SiLU(gate) * up or GELU-tanh(gate) * up (Gemma) from the
  fused gate/up output in one pass (float32 or bf16; its own vectorised exp, so within float32
  rounding of torch's before any bf16 rounding).
- ``rms_norm_``: RMSNorm in place over rows or each head of rows (q/k norm, Gemma's
  post-attention and post-feed-forward norms); a float32 weight on bf16 rows is Gemma's
  ``1 + w``, applied in float32 before the one rounding (as the ``add_rms_norm_`` weight too).
- ``sample_rows``: one draw per row from softmax(logits) by inverse CDF with one uniform per
  row (the torch path draws Gumbel noise for every vocab entry: uniform, two logs, an add).
- ``argmax_rows``: the sampler's greedy argmax over a [rows, vocab] float32 or bf16 batch, one
  row per task (torch's CPU argmax took 1.6 ms for 32 x 49152).
- ``amx_linear`` (with ``amx_pack_weight``, ``amx_available``): bf16 x @ W.T on AMX tiles for
  decode-sized batches, where a step's time is streaming the weights from DRAM once (oneDNN
  reached about half of the bandwidth there); compiled only where the CPU has AMX.
- ``dpbf16_linear`` (with ``dpbf16_pack_weight``, ``dpbf16_available``): the same on
  AVX512-BF16's VDPBF16PS for CPUs without AMX (1.3-1.6x oneDNN's packed kernel at 1-64 rows on
  a 2-core Zen 5); compiled only where the CPU has AVX512-BF16.
- ``fma_linear`` (with ``fma_pack_weight``, ``fma_available``): the same for CPUs with FMA but
  no bf16 dot products (AVX2): bf16 weights widened to float32 in registers, FMA accumulation;
  and for float32 weights on every CPU with FMA (1.5-2x oneDNN's packed float32 kernel at 1-16
  rows on a 2-core Zen 5).
- ``lora_add_``: batched LoRA updates of a step's rows, each segment of rows with its adapter
  slot's A and B (`mstar.kernels.lora`).
- ``decode_layers``: every decoder layer of a decode step in one call, over the kernels
  above in the order `DecoderLayer.forward` calls them (the same bits): at batch 1 the ~25
  Python dispatches per layer around them were ~15% of a step. Llama's block and what Qwen3
  and Gemma 3 add to it (q/k norm, sandwich norms, GELU-tanh, per-layer RoPE table, window
  and KV group: `DecodeLayout` in decode_loop.h).

These are per-layer ops on small tensors in a decode step, where dispatch and passes over memory
cost more than the arithmetic: SmolLM2 at batch 32 ran ~20 of them per layer around the GEMMs.

The sources are ``csrc/*.cpp``, compiled once per ISA level (`cpu_isa`; `build`) into a cache
every process shares; `load` runs the highest level the CPU has (or ``MSTAR_CPU_ISA``'s) and
logs which. Without a compiler it loads a prebuilt build of the same sources and torch from
the cache (the engine image ships every level); where it has neither, or the build fails, the
engine keeps the torch path and says why; the tests build every level the machine runs and fail
on a build error.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import torch

from mstar.kernels import cpu_isa

log = logging.getLogger(__name__)

#: Set to 0 to keep the torch path even where the kernels build (A/B measurements).
ENV_SWITCH = "MSTAR_CPU_KERNELS"

#: what the extension exports
FUNCTIONS = (
    "paged_decode",
    "paged_prefill",
    "write_kv",
    "add_rms_norm_",
    "rope_",
    "argmax_rows",
    "silu_mul",
    "gelu_tanh_mul",
    "rms_norm_",
    "sample_rows",
    "amx_available",
    "amx_pack_weight",
    "amx_linear",
    "dpbf16_available",
    "dpbf16_pack_weight",
    "dpbf16_linear",
    "fma_available",
    "fma_pack_weight",
    "fma_linear",
    "decode_layers",
    "isa_level",
    "quant_vnni",
    "quant_linear",
    "quant_dequantize_",
    "moe_experts",
)

#: dtypes ``paged_decode``, ``write_kv``, the glue ops and ``argmax_rows`` handle
DTYPES = (torch.float32, torch.bfloat16)

#: head dims ``paged_decode`` is instantiated for (whole vectors of 16 or 8 floats per row)
HEAD_DIMS = (16, 32, 64, 128, 256)


def supports_head_dim(head_dim: int) -> bool:
    """True for the head dims the decode kernel is compiled for (`HEAD_DIMS`)."""
    return head_dim in HEAD_DIMS


def heads_contiguous(x: torch.Tensor) -> bool:
    """[T, H, D] whose heads are back-to-back rows of D, the layout the kernels read (a slice
    of fused QKV rows qualifies)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def load_level(level: cpu_isa.Level) -> Any:
    """One level's extension, built if needed (prebuilt without a compiler); raises
    RuntimeError when the build fails or, without a compiler, none is prebuilt."""
    return _load_level(level.name)


@functools.cache
def _load_level(name: str) -> Any:
    from mstar.kernels import build  # here: `python -m mstar.kernels.build` imports this package

    level = cpu_isa.resolve(name)
    try:
        path = build.library_path(level)
    except build.NoCompiler as exc:
        path = _prebuilt(level, exc)
    else:
        _build(level, path)
    spec = importlib.util.spec_from_file_location(build.module_name(level), path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(level: cpu_isa.Level, path: Path) -> None:
    """Builds the level with this machine's compiler, or finds its build up to date."""
    from mstar.kernels import build

    if not path.exists():
        # The first start compiles for about a minute: say so before it, not only after.
        log.info(
            "CPU kernels: building level %s into %s (first start only; ~1 min on 2 cores; "
            "`python -m mstar.kernels.build` does it ahead of time)",
            level.name,
            path.parent,
        )
    seconds = build.build([level])
    if seconds > 1:
        log.info("CPU kernels: built level %s in %.1f s", level.name, seconds)


def _prebuilt(level: cpu_isa.Level, no_compiler: Exception) -> Path:
    """Without a compiler, a prebuilt build of the level (the engine image ships every one);
    RuntimeError naming both causes when the cache holds none."""
    from mstar.kernels import build

    path = build.prebuilt_library(level)
    if path is None:
        where = build.cache_root() / build.source_key()
        raise RuntimeError(f"{no_compiler}, and no prebuilt build of level {level.name} in {where}")
    log.info("CPU kernels: no C++ compiler here; loading the prebuilt %s", path)
    return path


@functools.cache
def load() -> Any | None:
    """The extension for this CPU's level, or None (switched off, or the build failed: logged)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        log.info("CPU kernels switched off (%s=0): torch path", ENV_SWITCH)
        return None
    level = cpu_isa.chosen_level()  # a bad MSTAR_CPU_ISA is the user's error: it raises
    try:
        module = load_level(level)
    except Exception as exc:  # no compiler and no prebuilt build, or a failed build: torch path
        log.warning("CPU kernels unavailable (%s); using the torch path", exc)
        return None
    log.info("CPU kernels: ISA level %s (%s)", level.name, level.summary)
    return module


def loaded_level() -> str | None:
    """The ISA level of the kernels this process runs; None when it loaded none (or not yet:
    this never builds)."""
    module = load() if load.cache_info().currsize else None
    return None if module is None else str(module.isa_level())
