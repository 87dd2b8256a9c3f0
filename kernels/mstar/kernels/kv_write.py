"""Scatter a step's new K/V rows into one layer's paged cache.

A layer's cache view is ``[pages, 2, page_size, kv_heads, head_dim]`` (K at index 0, V at 1, the
NHD layout FlashInfer reads). Slots are flat ``page * page_size + offset`` ids, so the engine's
page table is the only thing that knows where a token lives.
"""

from __future__ import annotations

import torch

from mstar.kernels import cpu_kernels


def slot_rows(write_slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Row ids of the K entries in ``kv_layer.view(pages * 2 * page_size, H, D)``.

    The V row of a slot is the K row plus ``page_size``.
    """
    pages = torch.div(write_slots, page_size, rounding_mode="floor")
    return pages * (2 * page_size) + (write_slots - pages * page_size)


def write_kv(
    kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, write_slots: torch.Tensor
) -> None:
    """Write k, v [T, Hkv, D] into ``kv_layer`` at flat slots ``write_slots`` (int64 [T])."""
    if k.shape[0] == 0:
        return
    num_pages, two, page_size, heads, dim = kv_layer.shape
    if two != 2:
        raise ValueError(
            f"kv_layer must be [pages, 2, page_size, H, D], got {tuple(kv_layer.shape)}"
        )
    slots = write_slots.to(device=kv_layer.device, dtype=torch.int64)
    kernels = cpu_kernels.load() if kv_layer.device.type == "cpu" else None
    if (
        kernels is not None
        and kv_layer.is_contiguous()
        and k.dtype == kv_layer.dtype
        and v.dtype == kv_layer.dtype
        and cpu_kernels.heads_contiguous(k)
        and cpu_kernels.heads_contiguous(v)
    ):
        kernels.write_kv(kv_layer, k, v, slots.contiguous())
        return
    if kv_layer.is_contiguous():
        flat = kv_layer.view(num_pages * 2 * page_size, heads, dim)
        rows = slot_rows(slots, page_size)
        flat.index_copy_(0, rows, k.to(kv_layer.dtype))
        flat.index_copy_(0, rows + page_size, v.to(kv_layer.dtype))
        return
    pages = torch.div(slots, page_size, rounding_mode="floor")
    offsets = slots - pages * page_size
    kv_layer[pages, 0, offsets] = k.to(kv_layer.dtype)
    kv_layer[pages, 1, offsets] = v.to(kv_layer.dtype)
