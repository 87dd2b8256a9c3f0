"""The device tensor, in FlashInfer's paged NHD layout; all layout knowledge lives here."""

from __future__ import annotations

import torch

from mstar.engine.resources.host_copy import to_device
from mstar.engine.resources.kv.config import KVConfig

__all__ = ["KVCache"]


class KVCache:
    """One tensor ``[slots, pages, 2 (K/V), page_size, kv_heads, head_dim]``.

    ``slots`` is the number of layers a page holds: every layer, or on a hybrid model a KV
    group's share (`KVGroups`); ``layer_view(i)`` is layer ``i``'s slot over every page.

    A write slot is ``page * page_size + offset``: the flat token index a layer's K (or V)
    plane has once ``[pages, page_size]`` is merged, which is what `KVPlan.write_slots` holds.
    """

    def __init__(self, config: KVConfig) -> None:
        self.page_size = config.page_size
        self.num_layers = config.num_layers
        self.groups = config.groups
        self.layer_slot = config.groups.layer_slot
        self.tensor = torch.zeros(
            (
                config.groups.slots,
                config.num_pages,
                2,
                config.page_size,
                config.num_kv_heads,
                config.head_dim,
            ),
            dtype=config.dtype,
            device=config.device,
        )

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: K and V of its layers (one KV group's, on a hybrid model)."""
        t = self.tensor
        return t.numel() // t.shape[1] * t.element_size()

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def layer_view(self, layer: int) -> torch.Tensor:
        """``[pages, 2, page_size, kv_heads, head_dim]``: what the attention kernel reads."""
        return self.tensor[self.layer_slot[layer]]

    def write_tokens(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, write_slots: torch.Tensor
    ) -> None:
        """Scatter ``k``/``v`` (``[tokens, kv_heads, head_dim]``) into their slots."""
        view = self.layer_view(layer)
        page = torch.div(write_slots, self.page_size, rounding_mode="floor")
        offset = write_slots - page * self.page_size
        view[page, 0, offset] = k.to(view.dtype)
        view[page, 1, offset] = v.to(view.dtype)

    def read_tokens(
        self, layer: int, write_slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K and V back from slots (tests and reference attention)."""
        view = self.layer_view(layer)
        page = torch.div(write_slots, self.page_size, rounding_mode="floor")
        offset = write_slots - page * self.page_size
        return view[page, 0, offset], view[page, 1, offset]

    def gather_pages(self, pages: list[int]) -> torch.Tensor:
        """Every slot, K and V, of ``pages``: ``[slots, len(pages), 2, ps, heads, dim]``."""
        index = to_device(pages, torch.long, self.tensor.device)
        return self.tensor.index_select(1, index)

    def scatter_pages(self, pages: list[int], data: torch.Tensor) -> None:
        index = to_device(pages, torch.long, self.tensor.device)
        self.tensor.index_copy_(1, index, data.to(self.tensor.device, self.tensor.dtype))
