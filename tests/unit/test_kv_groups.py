"""`KVGroups`: how a model's layers split into equal-sized KV groups, and what a group keeps."""

from __future__ import annotations

import pytest

from mstar.engine.resources.kv import KVConfig
from mstar.engine.resources.kv.groups import KVGroups, live_from


def _gemma(layers: int, window: int = 512) -> list[int]:
    return [window if (i + 1) % 6 else 0 for i in range(layers)]


def test_gemma3_270m_is_six_groups_of_three() -> None:
    g = KVGroups.for_layers(18, _gemma(18))
    assert g.slots == 3 and g.labels[0] == "main" and len(g.labels) == 6
    assert g.windows == (0, 512, 512, 512, 512, 512)
    assert [i for i in range(18) if g.layer_group[i] == 0] == [5, 11, 17]
    # every (group, slot) holds exactly one layer
    assert len({(g.layer_group[i], g.layer_slot[i]) for i in range(18)}) == 18


def test_uneven_counts_use_their_gcd() -> None:
    g = KVGroups.for_layers(26, _gemma(26))  # Gemma 3 1B: 4 full, 22 sliding
    assert g.slots == 2
    assert g.windows.count(0) == 2 and g.labels[1] == "full1"
    assert len(g.labels) == 13


@pytest.mark.parametrize("windows", [(), (0, 0, 0), (8, 8, 8), (8, 16, 8)])
def test_one_group_without_a_full_and_a_sliding_layer(windows: tuple[int, ...]) -> None:
    g = KVGroups.for_layers(3, windows)
    assert g.labels == ("main",) and g.windows == (0,) and g.slots == 3 and not g.hybrid


def test_live_pages_keep_the_window() -> None:
    assert live_from(100, 0, 4) == 0
    assert live_from(8, 8, 4) == 0  # position 8 still reads key 1
    assert live_from(9, 8, 4) == 0
    assert live_from(13, 8, 4) == 1  # keys 6..13: page 0 is gone
    g = KVGroups.for_layers(6, _gemma(6, 8))
    # 4096 tokens in 16-token pages: 256 for the full layer, the last 8 keys' pages per sliding one
    assert g.live_pages(4096, 16) == 256 + 5 * (256 - (4096 - 8 + 1) // 16)


def test_hybrid_needs_the_sink_page() -> None:
    with pytest.raises(ValueError, match="sink page"):
        KVConfig(6, 1, 8, 16, 4, layer_windows=tuple(_gemma(6, 8)), reserve_sink_page=False)
    cfg = KVConfig(6, 1, 8, 16, 4, layer_windows=tuple(_gemma(6, 8)))
    assert cfg.groups.slots == 1 and len(cfg.groups.labels) == 6
