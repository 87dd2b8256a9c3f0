"""Test helpers for the model and kernel tests: a tiny page pool and an AttentionContext.

The product's page allocator lives in the engine's KV resource; tests need only enough of one to
drive the decoder through the real paged kernels: pages handed out in a scrambled order, per-step
CSR plans, and a context that writes K/V with ``write_kv`` and attends with a backend.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from mstar.engine.model.config import ModelConfig
from mstar.engine.model.decoder import Decoder
from mstar.kernels import PagedAttentionBackend, TorchPagedAttention, write_kv


class PagedPool:
    """A KV cache [layers, pages, 2, page_size, Hkv, D] with a shuffled free list."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        backend: PagedAttentionBackend | None = None,
    ) -> None:
        self.cfg = cfg
        self.page_size = page_size
        self.kv = torch.zeros(
            cfg.num_layers, num_pages, 2, page_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype
        )
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.backend = backend or TorchPagedAttention()

    def step(
        self, decoder: Decoder, batch: Sequence[tuple[int, Sequence[int]]], all_logits: bool = False
    ) -> torch.Tensor:
        """Run one flat step: ``batch`` is [(seq_id, new token ids)]; returns float32 logits.

        Logits are for the last new token of each sequence, or for every new token (the
        decoder's come in the model's dtype; widening bf16 to float32 is exact).
        """
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qo = [0]
        kv_indptr = [0]
        kv_indices: list[int] = []
        last_len: list[int] = []
        logit_rows: list[int] = []
        s = self.page_size
        for seq, new in batch:
            start = self.lens.get(seq, 0)
            pages = self.pages.setdefault(seq, [])
            end = start + len(new)
            while len(pages) * s < end:
                pages.append(self.free.pop())
            for i, tok in enumerate(new):
                pos = start + i
                ids.append(int(tok))
                positions.append(pos)
                slots.append(pages[pos // s] * s + pos % s)
            self.lens[seq] = end
            qo.append(qo[-1] + len(new))
            used = (end + s - 1) // s
            kv_indices.extend(pages[:used])
            kv_indptr.append(len(kv_indices))
            last_len.append(end - (used - 1) * s)
            if all_logits:
                logit_rows.extend(range(qo[-2], qo[-1]))
            else:
                logit_rows.append(qo[-1] - 1)
        i32 = torch.int32
        self.backend.plan(
            torch.tensor(qo, dtype=i32),
            torch.tensor(kv_indptr, dtype=i32),
            torch.tensor(kv_indices, dtype=i32),
            torch.tensor(last_len, dtype=i32),
            num_qo_heads=self.cfg.num_heads,
            num_kv_heads=self.cfg.num_kv_heads,
            head_dim=self.cfg.head_dim,
            page_size=s,
            sm_scale=self.cfg.attn_scale,
        )
        windows = tuple(self.cfg.window(i) for i in range(self.cfg.num_layers))
        ctx = PoolContext(self.kv, self.backend, torch.tensor(slots, dtype=torch.int64), windows)
        logits: torch.Tensor = decoder(
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            ctx,
            torch.tensor(logit_rows, dtype=torch.int64),
        )
        return logits.float()


class PoolContext:
    """AttentionContext over a PagedPool for one step."""

    def __init__(
        self,
        kv: torch.Tensor,
        backend: PagedAttentionBackend,
        slots: torch.Tensor,
        windows: tuple[int, ...] = (),
    ) -> None:
        self.kv = kv
        self.backend = backend
        self.slots = slots
        self.windows = windows

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        write_kv(self.kv[layer_idx], k, v, self.slots)
        window = self.windows[layer_idx] if self.windows else 0
        return self.backend.run(q, self.kv[layer_idx], window, sinks)


def greedy(
    decoder: Decoder,
    pool: PagedPool,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
) -> list[list[int]]:
    """Batched greedy decoding of several prompts through the paged pool."""
    seqs = list(range(1000, 1000 + len(prompts)))
    logits = pool.step(decoder, list(zip(seqs, prompts, strict=True)))
    out: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        nxt = logits.argmax(-1).tolist()
        for i, t in enumerate(nxt):
            out[i].append(int(t))
        if step + 1 == max_new_tokens:
            break
        logits = pool.step(decoder, [(s, [t]) for s, t in zip(seqs, nxt, strict=True)])
    return out
