"""Decode-only paged attention cases: KV scattered over a shuffled page pool, one query per row."""

from __future__ import annotations

import torch

from mstar.kernels import write_kv

PagedPlan = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def decode_case(
    lens: list[int],
    *,
    page_size: int,
    heads: tuple[int, int, int],
    seed: int,
    dtype: torch.dtype,
    q_scale: float = 1.0,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, PagedPlan]:
    """(pool, dense (k, v) per row, q [rows, Hq, D], CSR plan) on the CPU; ``heads`` is
    (q heads, kv heads, head dim), ``q_scale`` sharpens the attention."""
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in lens) + 4
    pool = torch.zeros(num_pages, 2, page_size, hkv, d, dtype=dtype)
    order = torch.randperm(num_pages, generator=gen).tolist()
    kv_indptr, indices, last, dense = [0], [], [], []
    for n in lens:
        pages = [order.pop() for _ in range(-(-n // page_size))]
        k = torch.randn(n, hkv, d, generator=gen).to(dtype)
        v = torch.randn(n, hkv, d, generator=gen).to(dtype)
        slots = torch.tensor([pages[t // page_size] * page_size + t % page_size for t in range(n)])
        write_kv(pool, k, v, slots)
        dense.append((k, v))
        indices += pages
        kv_indptr.append(len(indices))
        last.append(n - page_size * (len(pages) - 1))
    q = (torch.randn(len(lens), hq, d, generator=gen) * q_scale).to(dtype)
    i32 = torch.int32
    plan = (
        torch.arange(len(lens) + 1, dtype=i32),
        torch.tensor(kv_indptr, dtype=i32),
        torch.tensor(indices, dtype=i32),
        torch.tensor(last, dtype=i32),
    )
    return pool, dense, q, plan
