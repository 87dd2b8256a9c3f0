"""Checking a fused decode step against the layer-by-layer path on the same step."""

from __future__ import annotations

from typing import Any

import torch


def compare_fused_steps(decoder: Any) -> list[int]:
    """Wrap ``decoder.forward`` so each step that runs fused (`Decoder.fused_decode`) runs
    again layer by layer and must give the same logits, bit for bit (the same K/V written to
    the same slots twice leaves the cache as one write does). Returns the list the wrapper
    fills with each fused step's row count."""
    forward = decoder.forward
    fused_rows: list[int] = []

    def both_ways(ids: torch.Tensor, positions: torch.Tensor, attn: Any, rows: torch.Tensor):
        fused = decoder._fused_layers(attn, ids.shape[0]) is not None
        logits = forward(ids, positions, attn, rows)
        if fused:
            fused_rows.append(ids.shape[0])
            bundle = decoder.fused_decode
            decoder.fused_decode = None
            try:
                assert torch.equal(logits, forward(ids, positions, attn, rows))
            finally:
                decoder.fused_decode = bundle
        return logits

    decoder.forward = both_ways
    return fused_rows
