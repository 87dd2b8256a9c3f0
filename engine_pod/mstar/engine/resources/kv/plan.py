"""`KVPlan`: one step's paged addressing, built on the host in one pass over the segments."""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from mstar.engine.resources.kv.config import pages_for
from mstar.engine.resources.kv.stream import Stream
from mstar.engine.resources.step import Segment

__all__ = ["KVPlan", "build_plan"]

_EMPTY: list[int] = []


class KVPlan(NamedTuple):
    """The KV resource's plan output, one per step, rows in step (segment) order.

    The four FlashInfer arrays (``qo_indptr``, ``kv_indptr``, ``kv_indices``,
    ``kv_last_page_len``) and the length arrays are int32 CPU tensors, so a wrapper's `plan`
    never syncs. ``write_slots`` (``page * page_size + offset`` of each new token, in token
    order) lives on the cache's device, ready for the K/V scatter.
    """

    request_ids: tuple[str, ...]
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    write_slots: torch.Tensor
    num_tokens: int
    is_decode: bool
    page_size: int
    #: A hybrid model's other KV groups (`KVGroups` order after main), same rows.
    groups: tuple[KVPlan, ...] = ()


def build_plan(
    segments: Sequence[Segment],
    streams: Mapping[str, Mapping[str, Stream]],
    page_size: int,
    device: torch.device,
) -> KVPlan:
    """Build the plan from the streams' current lengths (callers hold the manager lock).

    Pages are sliced to ceil(seq_len / page_size), so a stream's high-water mark never reaches
    the kernel. Everything is gathered into `array.array`s first and wrapped with one
    ``torch.frombuffer`` per array: per-element tensor ops would cost more than the whole loop.
    A zero-length row (a zero-span read of an empty stream) gets ``kv_last_page_len`` 0.
    """
    ps = page_size
    rids: list[str] = []
    qo = array("i", (0,))
    kv = array("i", (0,))
    indices = array("i")
    last = array("i")
    seq_lens = array("i")
    prefix_lens = array("i")
    slots = array("q")
    q = 0
    k = 0
    decode = True
    for rid, label, span in segments:
        per = streams.get(rid)
        stream = per.get(label) if per is not None else None
        if stream is None:
            stored = 0
            pages = _EMPTY
        else:
            stored = stream.stored_len
            pages = stream.pages
        seq = stored + span
        npages = pages_for(seq, ps)
        held = len(pages)
        if npages > held:
            raise RuntimeError(
                f"KV plan for {rid!r}/{label!r} needs {npages} pages but the stream holds "
                f"{held}: the step was not admitted"
            )
        rids.append(rid)
        q += span
        qo.append(q)
        k += npages
        kv.append(k)
        if npages == held:
            indices.extend(pages)
        else:
            indices.extend(pages[:npages])
        last_len = seq - (npages - 1) * ps if npages else 0
        last.append(last_len)
        seq_lens.append(seq)
        prefix_lens.append(stored)
        if span == 1:
            slots.append(pages[npages - 1] * ps + last_len - 1)
        else:
            decode = False
            t = stored
            while t < seq:
                pi = t // ps
                end = min(seq, (pi + 1) * ps)
                base = (pages[pi] - pi) * ps
                slots.extend(range(base + t, base + end))
                t = end
    if device.type == "cpu":
        write_slots = _tensor(slots, torch.int64)
    else:
        write_slots = _tensor(slots, torch.int64).pin_memory().to(device, non_blocking=True)
    i32 = torch.int32
    return KVPlan(
        tuple(rids),
        _tensor(qo, i32),
        _tensor(kv, i32),
        _tensor(indices, i32),
        _tensor(last, i32),
        _tensor(seq_lens, i32),
        _tensor(prefix_lens, i32),
        write_slots,
        q,
        decode and bool(rids),
        ps,
    )


def _tensor(values: array[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over the array's buffer: ~3x cheaper than `torch.tensor(list)`.

    The tensor keeps the array alive and nothing else references it, so sharing is safe.
    """
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(values, dtype=dtype)
