"""How much float scratch FlashInfer's FA2 attention needs, from the model's heads and the batch.

FlashInfer's ``plan`` carves split-KV partial outputs (``tmp_v``, fp32, head_dim wide) and their
log-sum-exps (``tmp_s``) out of the float workspace it was given, and fails the plan ("Buffer
overflow") when they do not fit. A fixed 32 MiB was too small for a 64-head model at batch 64, so
the size is computed here, mirroring ``PrefillSplitQOKVIndptr`` / ``PrefillPlan`` in FlashInfer's
``attention/scheduler.cuh`` (read at 0.6.13, the pinned version), which both the prefill wrapper
and the tensor-core decode wrapper run:

- a CTA works on ``cta_tile_q`` packed query rows (query tokens x GQA group): 128 past 64 rows
  when head_dim < 256, else 64 past 16, else 16 (Ampere and newer);
- at most ``2 * num_sms // num_kv_heads`` work items when KV is split (``max_batch_size_if_split``);
  eager plans split only when they fit under it; CUDA-graph plans always split and pad the work
  list to ``max(that, ceil(batch * group / cta_tile_q) + batch - 1)``;
- scratch = ``num_qo_heads * items * cta_tile_q * (head_dim + 1) * 4`` bytes, plus alignment.
"""

from __future__ import annotations

MIB = 1024 * 1024
#: FA2 launches at most two CTAs per SM when it splits KV (``num_blocks_per_sm`` in the plan).
_CTAS_PER_SM = 2
#: ``aligned_alloc_offset(..., 16)`` for tmp_v and tmp_s: at most 15 bytes of padding each.
_ALIGN_SLACK = 2 * 16


def fa2_cta_tile_q(packed_qo_len: int, head_dim: int) -> int:
    """FlashInfer's ``FA2DetermineCtaTileQ`` on sm80 and newer."""
    if packed_qo_len > 64 and head_dim < 256:
        return 128
    return 64 if packed_qo_len > 16 else 16


def _check_heads(num_qo_heads: int, num_kv_heads: int, head_dim: int, num_sms: int) -> None:
    if min(num_qo_heads, num_kv_heads, head_dim, num_sms) < 1:
        raise ValueError("heads, head_dim and num_sms must be positive")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} not a multiple of {num_kv_heads}")


def _scratch(num_qo_heads: int, items: int, cta_tile_q: int, head_dim: int) -> int:
    return num_qo_heads * items * cta_tile_q * (head_dim + 1) * 4 + _ALIGN_SLACK


def eager_scratch_bytes(num_qo_heads: int, num_kv_heads: int, head_dim: int, num_sms: int) -> int:
    """Upper bound for any eager (non-graph) prefill or tensor-core decode plan."""
    _check_heads(num_qo_heads, num_kv_heads, head_dim, num_sms)
    max_items = _CTAS_PER_SM * num_sms // num_kv_heads
    return _scratch(num_qo_heads, max_items, fa2_cta_tile_q(65, head_dim), head_dim)


def graph_decode_scratch_bytes(
    num_qo_heads: int, num_kv_heads: int, head_dim: int, num_sms: int, batch_size: int
) -> int:
    """What a CUDA-graph decode plan of ``batch_size`` one-token rows takes (it always splits)."""
    _check_heads(num_qo_heads, num_kv_heads, head_dim, num_sms)
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    group = num_qo_heads // num_kv_heads
    cta = fa2_cta_tile_q(group, head_dim)
    tiles = -(-batch_size * group // cta) + batch_size - 1
    items = max(_CTAS_PER_SM * num_sms // num_kv_heads, tiles)
    return _scratch(num_qo_heads, items, cta, head_dim)


def workspace_bytes(
    num_qo_heads: int, num_kv_heads: int, head_dim: int, num_sms: int, max_graph_batch: int
) -> int:
    """One float workspace for every wrapper of a backend, whole MiB.

    The wrappers share it safely: FlashInfer's kernels only use it while they run, and every
    wrapper's kernels run in order on the one stream the engine uses.
    """
    need = eager_scratch_bytes(num_qo_heads, num_kv_heads, head_dim, num_sms)
    if max_graph_batch > 0:
        graph = graph_decode_scratch_bytes(
            num_qo_heads, num_kv_heads, head_dim, num_sms, max_graph_batch
        )
        need = max(need, graph)
    return -(-need // MIB) * MIB
