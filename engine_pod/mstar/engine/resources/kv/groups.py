"""KV groups: how a model's layers split the page pool when some of them slide a window.

A model whose layers all see every key keeps one group, the ``"main"`` label, whose page holds
every layer; so does one whose layers all slide a window (Mistral): its pages are kept, the
kernels mask the window. A *hybrid* model (Gemma 3: five sliding layers
to one full one) gets equal-sized groups of layers, as vLLM's hybrid KV cache manager does: a
page holds ``slots`` layers, each group has its own label (a stream per request) and page table,
and all groups draw on one pool. A sliding group's stream gives its pages back as soon as every
key on them has left the window, so a long request holds its sliding layers' window only.

Equal-sized groups (``gcd`` of the full and sliding layer counts) keep one page size, so one
arena, one host tier, one prefix index and one refusal path serve every group unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HOLE", "MAIN_LABEL", "KVGroups", "live_from"]

#: The label of a request's first group (its full-attention layers on a hybrid model).
MAIN_LABEL = "main"

#: What a stream's page list holds where a sliding group gave a page back: the arena's sink
#: page, which owner counts ignore and out-of-window reads never reach.
HOLE = 0


def live_from(stored: int, window: int, page_size: int) -> int:
    """The first page a query at position ``stored`` still reads (0 for a full layer)."""
    if window <= 0:
        return 0
    return max(0, stored - window + 1) // page_size


@dataclass(frozen=True)
class KVGroups:
    """``labels[g]`` / ``windows[g]`` per group; ``layer_group[i]`` / ``layer_slot[i]``: the
    group of layer ``i`` and its index inside a page (``slots`` layers per page)."""

    labels: tuple[str, ...]
    windows: tuple[int, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    slots: int

    @classmethod
    def for_layers(cls, num_layers: int, layer_windows: Sequence[int] = ()) -> KVGroups:
        windows = tuple(layer_windows) or (0,) * num_layers
        if len(windows) != num_layers:
            raise ValueError(f"{len(windows)} layer windows for {num_layers} layers")
        kinds = sorted(set(windows))
        if len(kinds) == 1 or kinds[0] != 0:
            # Nothing to split, or no full layer to anchor the prefix chain: one page holds
            # every layer and nothing is given back early (the kernels still mask the window).
            return cls((MAIN_LABEL,), (0,), (0,) * num_layers, tuple(range(num_layers)), num_layers)
        members = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
        slots = math.gcd(*(len(m) for m in members.values()))
        labels: list[str] = []
        group_windows: list[int] = []
        layer_group = [0] * num_layers
        layer_slot = [0] * num_layers
        for w in kinds:  # full layers (window 0) first: group 0 is "main"
            for start in range(0, len(members[w]), slots):
                g = len(labels)
                labels.append(MAIN_LABEL if g == 0 else f"{'swa' if w else 'full'}{g}")
                group_windows.append(w)
                for slot, layer in enumerate(members[w][start : start + slots]):
                    layer_group[layer] = g
                    layer_slot[layer] = slot
        return cls(
            tuple(labels), tuple(group_windows), tuple(layer_group), tuple(layer_slot), slots
        )

    @property
    def hybrid(self) -> bool:
        return len(self.labels) > 1

    def window_of(self, label: str) -> int:
        return self.windows[self.labels.index(label)]

    def live_pages(self, num_tokens: int, page_size: int) -> int:
        """Pages a request holding ``num_tokens`` tokens keeps across all groups."""
        total = (num_tokens + page_size - 1) // page_size
        return sum(total - live_from(num_tokens, w, page_size) for w in self.windows)
