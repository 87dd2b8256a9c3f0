"""TorchPagedAttention and write_kv against a dense per-sequence reference.

Pages are handed out in a random order, sequences mix decode (1 query), chunked prefill (some
queries at the end of a longer cache) and full prefill, with GQA and page-boundary cases.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from external_tools import require_tool

from mstar.kernels import (
    FlashInferPagedAttention,
    TorchPagedAttention,
    cpu_isa,
    cpu_kernels,
    flashinfer_available,
    select_attention_backend,
    slot_rows,
    write_kv,
)
from mstar.kernels.paged_attention import KernelDecodeStep


@pytest.fixture(autouse=True)
def _one_thread():
    # The shared 2-core test host makes OpenMP threads spin against each other.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference(q, k, v, causal=True, window=0, scale=None, sinks=None):
    """Dense attention for one sequence: q [Q,Hq,D] are the last Q of k/v [L,Hkv,D];
    ``window``: each query sees its last ``window`` keys (its own included); ``sinks`` [Hq]:
    one more score per head that weighs no value (transformers' gpt-oss eager attention)."""
    qn, hq, d = q.shape
    length, hkv, _ = k.shape
    g = hq // hkv
    kk = k.double().repeat_interleave(g, dim=1)  # [L, Hq, D]
    vv = v.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * (scale or 1 / math.sqrt(d))
    qpos = torch.arange(length - qn, length)[:, None]
    kpos = torch.arange(length)[None, :]
    if causal:
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
    if window:
        scores = scores.masked_fill(kpos <= qpos - window, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(hq, qn, 1)
        return torch.einsum("hqk,khd->qhd", torch.cat((scores, sink), -1).softmax(-1)[..., :-1], vv)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


def build_case(seed, page_size, hq, hkv, d, specs, num_pages=64, dtype=torch.float32):
    """specs: [(kv_len, q_len)]. Returns pool, dense k/v per seq, q and the CSR plan."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pool = torch.zeros(num_pages, 2, page_size, hkv, d, dtype=dtype)
    free = list(range(num_pages))
    rng.shuffle(free)
    qo, kv_indptr, kv_indices, last = [0], [0], [], []
    dense, qs = [], []
    for kv_len, q_len in specs:
        n_pages = (kv_len + page_size - 1) // page_size
        pages = [free.pop() for _ in range(n_pages)]
        k = torch.randn(kv_len, hkv, d, generator=gen, dtype=dtype)
        v = torch.randn(kv_len, hkv, d, generator=gen, dtype=dtype)
        slots = torch.tensor(
            [pages[p // page_size] * page_size + p % page_size for p in range(kv_len)]
        )
        write_kv(pool, k, v, slots)
        dense.append((k, v))
        qs.append(torch.randn(q_len, hq, d, generator=gen, dtype=dtype))
        qo.append(qo[-1] + q_len)
        kv_indices += pages
        kv_indptr.append(len(kv_indices))
        last.append(kv_len - (n_pages - 1) * page_size)
    i32 = torch.int32
    plan = (
        torch.tensor(qo, dtype=i32),
        torch.tensor(kv_indptr, dtype=i32),
        torch.tensor(kv_indices, dtype=i32),
        torch.tensor(last, dtype=i32),
    )
    return pool, dense, torch.cat(qs), plan


CASES = [
    # (page_size, hq, hkv, [(kv_len, q_len)])
    (4, 6, 2, [(1, 1), (7, 1), (8, 1), (13, 1)]),  # decode only; last page full for 8
    (4, 6, 2, [(9, 9), (12, 5), (3, 1), (16, 16), (17, 1)]),  # mixed prefill/extend/decode
    (16, 4, 4, [(40, 40), (33, 2), (16, 1), (1, 1)]),  # MHA, page boundaries
    (1, 8, 2, [(5, 3), (2, 2), (6, 1)]),  # page_size 1: every token its own page
    (8, 9, 3, [(24, 24), (25, 8), (64, 1), (7, 7)]),  # SmolLM2's 9/3 heads
]


#: every ISA level this CPU runs (x86-64-v3 among them on any x86-64 machine with AVX2: its
#: 8-lane build), then the torch gather
LEVELS = [lvl.name for lvl in cpu_isa.supported_levels()]
PATHS = [*LEVELS, "torch-gather"]


@contextmanager
def _at_level(name: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernels of one ISA level's build, chosen as a user would, by MSTAR_CPU_ISA."""
    require_tool("g++")
    require_tool("ninja")
    monkeypatch.setenv(cpu_isa.ENV_LEVEL, name)
    cpu_kernels.load.cache_clear()
    kernels = cpu_kernels.load()
    assert kernels is not None and kernels.isa_level() == name
    try:
        yield
    finally:
        cpu_kernels.load.cache_clear()


@pytest.fixture(params=PATHS)
def use_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    """Both CPU paths: the C++ kernels reading pages in place (each level's build), and the
    torch gather."""
    if request.param == "torch-gather":
        yield False
        return
    with _at_level(request.param, monkeypatch):
        yield True


@pytest.fixture(params=LEVELS)
def kernel_level(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The C++ kernels at each ISA level this CPU runs."""
    with _at_level(request.param, monkeypatch):
        yield request.param


def test_cpu_kernels_build_here() -> None:
    """With a compiler on the machine the CPU backend takes the C++ attention kernels."""
    require_tool("g++")
    require_tool("ninja")
    assert cpu_kernels.load() is not None
    assert TorchPagedAttention().uses_kernels
    assert not TorchPagedAttention(use_kernels=False).uses_kernels


def test_cpu_kernels_switch_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
        assert not TorchPagedAttention().uses_kernels
    finally:
        cpu_kernels.load.cache_clear()


@pytest.mark.parametrize("page_size,hq,hkv,specs", CASES)
def test_torch_paged_matches_dense_reference(page_size, hq, hkv, specs, use_kernels):
    d = 16
    pool, dense, q, plan = build_case(1, page_size, hq, hkv, d, specs)
    backend = TorchPagedAttention(use_kernels=use_kernels)
    backend.plan(*plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size)
    out = backend.run(q, pool)
    assert out.shape == q.shape
    start = 0
    for (k, v), (_, q_len) in zip(dense, specs, strict=True):
        ref = reference(q[start : start + q_len], k, v)
        torch.testing.assert_close(out[start : start + q_len].double(), ref, atol=1e-5, rtol=1e-5)
        start += q_len


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("page_size,hq,hkv,specs", CASES[:3])
def test_sliding_window_matches_dense_reference(page_size, hq, hkv, specs, window, use_kernels):
    """A sliding-window layer (and a model's own softmax scale) on every path: decode rows,
    prompt chunks after cached keys, whole prompts; windows inside a page and across pages."""
    d, scale = 16, 0.3
    pool, dense, q, plan = build_case(2, page_size, hq, hkv, d, specs)
    backend = TorchPagedAttention(use_kernels=use_kernels)
    backend.plan(*plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size,
                 sm_scale=scale)  # fmt: skip
    full = backend.run(q, pool)  # a full layer of the same step is unaffected
    out = backend.run(q, pool, window)
    start = 0
    for (k, v), (_, q_len) in zip(dense, specs, strict=True):
        rows = slice(start, start + q_len)
        ref = reference(q[rows], k, v, window=window, scale=scale)
        torch.testing.assert_close(out[rows].double(), ref, atol=1e-5, rtol=1e-5)
        ref_full = reference(q[rows], k, v, scale=scale)
        torch.testing.assert_close(full[rows].double(), ref_full, atol=1e-5, rtol=1e-5)
        start += q_len


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("page_size,hq,hkv,specs", CASES[:3])
def test_attention_sinks_match_dense_reference(page_size, hq, hkv, specs, window, dtype,
                                               use_kernels):  # fmt: skip
    """gpt-oss's sinks on every path (decode rows, prompt chunks, whole prompts; full and
    sliding-window layers): logits large enough to take a real share of each softmax."""
    d, scale = 32, 0.3
    pool, dense, q, plan = build_case(3, page_size, hq, hkv, d, specs, dtype=dtype)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(5)) + 1.0
    backend = TorchPagedAttention(use_kernels=use_kernels)
    backend.plan(*plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size,
                 sm_scale=scale)  # fmt: skip
    out = backend.run(q, pool, window, sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    start = 0
    for (k, v), (_, q_len) in zip(dense, specs, strict=True):
        rows = slice(start, start + q_len)
        ref = reference(q[rows], k, v, window=window, scale=scale, sinks=sinks)
        torch.testing.assert_close(out[rows].double(), ref, atol=tol, rtol=tol)
        without = reference(q[rows], k, v, window=window, scale=scale)
        assert (ref - without).abs().max() > 1e-2  # the sinks matter here
        start += q_len


def test_random_layouts_many_seeds():
    for seed in range(12):
        rng = random.Random(seed)
        page_size = rng.choice([1, 2, 4, 8, 16])
        hkv = rng.choice([1, 2, 3])
        hq = hkv * rng.choice([1, 2, 3])
        specs = []
        for _ in range(rng.randint(1, 6)):
            kv_len = rng.randint(1, 40)
            q_len = rng.choice([1, kv_len, rng.randint(1, kv_len)])
            specs.append((kv_len, q_len))
        pool, dense, q, plan = build_case(seed, page_size, hq, hkv, 8, specs, num_pages=400)
        backend = TorchPagedAttention()
        backend.plan(*plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=8, page_size=page_size)
        out = backend.run(q, pool)
        start = 0
        for (k, v), (_, q_len) in zip(dense, specs, strict=True):
            ref = reference(q[start : start + q_len], k, v)
            torch.testing.assert_close(
                out[start : start + q_len].double(),
                ref,
                atol=1e-5,
                rtol=1e-5,
                msg=f"seed {seed} specs {specs}",
            )
            start += q_len


def test_plan_once_run_many_layers():
    """One plan serves every layer: each layer's cache gives its own answer."""
    specs = [(10, 3), (5, 1)]
    pool_a, dense_a, q, plan = build_case(3, 4, 4, 2, 8, specs)
    pool_b, _, _, _ = build_case(4, 4, 4, 2, 8, specs)  # same pages (same seed order)
    backend = TorchPagedAttention()
    backend.plan(*plan, num_qo_heads=4, num_kv_heads=2, head_dim=8, page_size=4)
    out_a = backend.run(q, pool_a)
    out_b = backend.run(q, pool_b)
    assert not torch.allclose(out_a, out_b)
    torch.testing.assert_close(
        out_a[:3].double(), reference(q[:3], *dense_a[0]), atol=1e-5, rtol=1e-5
    )


def test_non_causal_sees_whole_sequence():
    specs = [(6, 6), (9, 2)]
    pool, dense, q, plan = build_case(5, 4, 2, 1, 8, specs)
    backend = TorchPagedAttention()
    backend.plan(*plan, num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=4, causal=False)
    out = backend.run(q, pool)
    torch.testing.assert_close(
        out[:6].double(), reference(q[:6], *dense[0], causal=False), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        out[6:].double(), reference(q[6:], *dense[1], causal=False), atol=1e-5, rtol=1e-5
    )


def test_bfloat16_close_to_reference():
    specs = [(20, 20), (11, 1)]
    pool, dense, q, plan = build_case(6, 8, 4, 2, 16, specs, dtype=torch.bfloat16)
    backend = TorchPagedAttention()
    backend.plan(*plan, num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=8)
    out = backend.run(q, pool)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out[:20].double(), reference(q[:20], *dense[0]), atol=3e-2, rtol=3e-2
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_decode_rows_match_reference(
    dtype: torch.dtype, use_kernels: bool
) -> None:
    """Decode rows in bf16/fp16 (kernel or matmuls) beside a prefill row (SDPA path)."""
    specs = [(9, 1), (16, 1), (33, 1), (1, 1), (12, 5)]
    pool, dense, q, plan = build_case(7, 4, 9, 3, 16, specs, dtype=dtype)
    backend = TorchPagedAttention(use_kernels=use_kernels)
    backend.plan(*plan, num_qo_heads=9, num_kv_heads=3, head_dim=16, page_size=4)
    for _ in range(2):  # the cached additive mask is reused by the next layer
        out = backend.run(q, pool)
        start = 0
        for (_, q_len), (k, v) in zip(specs, dense, strict=True):
            rows = slice(start, start + q_len)
            torch.testing.assert_close(
                out[rows].double(), reference(q[rows], k, v), atol=3e-2, rtol=3e-2
            )
            start += q_len


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_real_head_dims(d: int, dtype: torch.dtype, use_kernels: bool) -> None:
    """Model-sized heads and long rows over scattered 16-token pages (SmolLM2's 9/3 heads)."""
    specs = [(1, 1), (16, 1), (17, 1), (250, 1), (96, 1)]
    pool, dense, q, plan = build_case(8, 16, 9, 3, d, specs, num_pages=40, dtype=dtype)
    backend = TorchPagedAttention(use_kernels=use_kernels)
    backend.plan(*plan, num_qo_heads=9, num_kv_heads=3, head_dim=d, page_size=16)
    out = backend.run(q, pool)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i, (k, v) in enumerate(dense):
        torch.testing.assert_close(
            out[i : i + 1].double(), reference(q[i : i + 1], k, v), atol=tol, rtol=tol
        )


def test_write_kv_places_rows_at_slots():
    pool = torch.zeros(5, 2, 4, 2, 3)
    k = torch.arange(3 * 2 * 3, dtype=torch.float32).view(3, 2, 3) + 1
    v = -k
    slots = torch.tensor([4 * 3 + 3, 0, 4 * 1 + 2])  # page 3 off 3, page 0 off 0, page 1 off 2
    write_kv(pool, k, v, slots)
    torch.testing.assert_close(pool[3, 0, 3], k[0])
    torch.testing.assert_close(pool[3, 1, 3], v[0])
    torch.testing.assert_close(pool[0, 0, 0], k[1])
    torch.testing.assert_close(pool[1, 1, 2], v[2])
    assert int((pool != 0).sum()) == 2 * k.numel()
    assert slot_rows(torch.tensor([4 * 3 + 3]), 4).tolist() == [3 * 8 + 3]


def test_write_kv_non_contiguous_view():
    """A layer view taken from a [pages, layers, ...] pool is strided; writes still land."""
    full = torch.zeros(6, 3, 2, 4, 1, 2)  # [pages, layers, 2, S, H, D]
    layer = full[:, 1]
    assert not layer.is_contiguous()
    k = torch.ones(2, 1, 2)
    write_kv(layer, k, 2 * k, torch.tensor([5, 22]))
    assert full[1, 1, 0, 1].tolist() == [[1.0, 1.0]]
    assert full[5, 1, 1, 2].tolist() == [[2.0, 2.0]]
    assert int((full != 0).sum()) == 8


@pytest.mark.parametrize(
    "qo,kv_indptr,last,msg",
    [
        ([0, 3], [0, 1], [2], "more queries than KV tokens"),
        ([0, 1], [0, 1], [5], "kv_last_page_len"),
        ([0, 1], [0, 0], [1], ">= 1 KV page"),
        ([0, 1, 2], [0, 1], [1], "len\\(kv_last_page_len\\) \\+ 1"),
    ],
)
def test_plan_rejects_malformed_layouts(qo, kv_indptr, last, msg):
    i32 = torch.int32
    with pytest.raises(ValueError, match=msg):
        TorchPagedAttention().plan(
            torch.tensor(qo, dtype=i32),
            torch.tensor(kv_indptr, dtype=i32),
            torch.tensor([0, 1], dtype=i32),
            torch.tensor(last, dtype=i32),
            num_qo_heads=2,
            num_kv_heads=1,
            head_dim=4,
            page_size=4,
        )


def test_run_checks_query_rows():
    pool, _, q, plan = build_case(7, 4, 2, 1, 4, [(5, 2)])
    backend = TorchPagedAttention()
    backend.plan(*plan, num_qo_heads=2, num_kv_heads=1, head_dim=4, page_size=4)
    with pytest.raises(ValueError, match="planned for 2 query rows"):
        backend.run(q[:1], pool)


def test_select_backend_on_cpu_is_torch():
    assert isinstance(select_attention_backend(torch.device("cpu")), TorchPagedAttention)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and flashinfer_available()), reason="needs CUDA + flashinfer"
)
@pytest.mark.parametrize("page_size,hq,hkv,specs", CASES[:3] + CASES[4:])
@pytest.mark.parametrize("decode_only", [False, True])
def test_flashinfer_matches_torch(page_size, hq, hkv, specs, decode_only):
    if decode_only:
        specs = [(kv, 1) for kv, _ in specs]
    d = 64
    pool, _, q, plan = build_case(2, page_size, hq, hkv, d, specs, dtype=torch.bfloat16)
    pool, q = pool.cuda(), q.cuda()
    ref = TorchPagedAttention("cuda")
    ref.plan(*plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size)
    fi = select_attention_backend(torch.device("cuda"))
    assert isinstance(fi, FlashInferPagedAttention)
    fi.plan(*plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size)
    for _ in range(2):  # the planned state serves repeated layer calls
        torch.testing.assert_close(
            fi.run(q, pool).float(), ref.run(q, pool).float(), atol=2e-2, rtol=2e-2
        )


@pytest.mark.parametrize(
    "page_size,hq,hkv,d",
    [(5, 16, 2, 128), (16, 8, 1, 256), (3, 4, 4, 32), (16, 12, 4, 64)],
    ids=["pages-of-5-group-8", "head-256-mqa", "pages-of-3-mha", "group-3"],
)
def test_decode_kernel_reads_q_in_place_from_fused_rows(page_size, hq, hkv, d, kernel_level):
    """A decode-only step hands the kernel q as a strided view of the fused QKV rows; blocks
    of 16 keys (8 on levels without AVX-512) straddle pages when the page size is not a
    multiple of them; heads of 128 and 256 take several register passes over the values where
    a pass holds fewer vectors than the head (AVX2, the baseline)."""
    specs = [(1, 1), (15, 1), (16, 1), (17, 1), (61, 1), (33, 1)]
    pool, dense, q, plan = build_case(9, page_size, hq, hkv, d, specs, num_pages=80)
    fused = torch.randn(len(specs), (hq + 2 * hkv) * d)
    fused[:, : hq * d] = q.reshape(len(specs), -1)
    q_view = fused[:, : hq * d].view(len(specs), hq, d)
    assert not q_view.is_contiguous()
    backend = TorchPagedAttention()
    assert backend.uses_kernels
    backend.plan(*plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size)
    out = backend.run(q_view, pool)
    for i, (k, v) in enumerate(dense):
        torch.testing.assert_close(
            out[i : i + 1].double(), reference(q[i : i + 1], k, v), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_prefill_kernel_prompts_and_chunks_from_fused_rows(
    d: int, dtype: torch.dtype, kernel_level: str
) -> None:
    """Fresh prompts and chunks after cached keys, across the kernel's 32-row blocks and its
    4-row tails, beside decode rows; q a strided view of fused QKV rows, 16-token pages; every
    level's build (the value sums in passes of a few vectors each on AVX2; on AMX, bf16 takes
    the tile kernel: one k-step of Q.K^T at 32, four passes of output tiles at 256)."""
    specs = [(70, 70), (1, 1), (140, 37), (5, 5), (33, 1), (200, 64), (2, 2)]
    hq, hkv, page_size = 9, 3, 16
    pool, dense, q, plan = build_case(10, page_size, hq, hkv, d, specs, 60, dtype)
    rows = q.shape[0]
    fused = torch.randn(rows, (hq + 2 * hkv) * d).to(dtype)
    fused[:, : hq * d] = q.reshape(rows, -1)
    q_view = fused[:, : hq * d].view(rows, hq, d)
    backend = TorchPagedAttention()
    assert backend.uses_kernels
    backend.plan(*plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size)
    out = backend.run(q_view, pool)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    start = 0
    for (k, v), (_, q_len) in zip(dense, specs, strict=True):
        ref = reference(q[start : start + q_len], k, v)
        torch.testing.assert_close(out[start : start + q_len].double(), ref, atol=tol, rtol=tol)
        start += q_len


def test_prefill_kernel_refuses_bad_lengths_and_pages() -> None:
    require_tool("g++")
    require_tool("ninja")
    kernel = cpu_kernels.load()
    assert kernel is not None
    pool = torch.zeros(4, 2, 4, 1, 16)
    q = torch.randn(6, 2, 16)
    out = torch.empty_like(q)
    i64 = torch.int64

    def call(table, kv_len, q_len, start=0):
        kernel.paged_prefill(
            q,
            pool,
            torch.tensor([table], dtype=i64),
            torch.tensor([kv_len]),
            torch.tensor([start]),
            torch.tensor([q_len]),
            0.25,
            out,
        )

    with pytest.raises(RuntimeError, match="bad lengths"):
        call([0, 1], 5, 6)  # more queries than keys
    with pytest.raises(RuntimeError, match="bad lengths"):
        call([0, 1], 9, 2)  # more keys than the table's pages hold
    with pytest.raises(RuntimeError, match="bad lengths"):
        call([0, 1], 6, 2, start=5)  # rows past the end of q
    with pytest.raises(RuntimeError, match="page 4 is outside the cache"):
        call([0, 4], 6, 6)
    call([2, 3], 6, 6)  # a valid call passes the same checks


def test_kernel_decode_step_matches_the_generic_path_and_declines_what_it_cannot_read():
    """A decode-only step resolved once (`KernelDecodeStep`) writes and attends exactly as
    `write_kv` + `run`; layouts the kernels do not read in place, prefill rows, a head dim they
    are not built for and a backend without kernels all keep the generic path."""
    require_tool("g++")
    require_tool("ninja")
    page_size, hq, hkv, d = 4, 6, 2, 32
    specs = [(1, 1), (7, 1), (8, 1), (13, 1)]
    pool, _, q, plan = build_case(11, page_size, hq, hkv, d, specs)
    kv_indptr, kv_indices, last = plan[1], plan[2], plan[3]
    # The newest token of each sequence: its page's slot `last - 1`.
    ends = kv_indices[(kv_indptr[1:] - 1).long()].long()
    slots = ends * page_size + last.long() - 1
    backend = TorchPagedAttention()
    backend.plan(*plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size)
    step = backend.decode_step(slots, pool.dtype)
    assert isinstance(step, KernelDecodeStep)
    gen = torch.Generator().manual_seed(5)
    fused = torch.randn(len(specs), (hq + 2 * hkv) * d, generator=gen)
    heads = fused.view(len(specs), hq + 2 * hkv, d)
    q, k, v = heads[:, :hq], heads[:, hq : hq + hkv], heads[:, hq + hkv :]
    fast_pool, slow_pool = pool.clone(), pool.clone()
    assert step.fits(q, k, v, fast_pool)
    fast = step(q, k, v, fast_pool)
    write_kv(slow_pool, k, v, slots)
    slow = backend.run(q, slow_pool)
    assert torch.equal(fast, slow) and torch.equal(fast_pool, slow_pool)
    # Not read in place: heads that are not whole rows, another dtype.
    strided = torch.randn(len(specs), hkv, 2 * d, generator=gen)[..., ::2]
    assert not step.fits(q, strided, v, fast_pool)
    assert not step.fits(q.double(), k.double(), v.double(), fast_pool)
    # Prefill rows, an unsupported head dim, no kernels: no resolved step.
    _, _, _, mixed = build_case(12, page_size, hq, hkv, d, [(5, 5), (7, 1)])
    backend.plan(*mixed, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size)
    assert backend.decode_step(slots[:2], pool.dtype) is None
    _, _, _, odd = build_case(13, page_size, hq, hkv, 24, specs)
    backend.plan(*odd, num_qo_heads=hq, num_kv_heads=hkv, head_dim=24, page_size=page_size)
    assert backend.decode_step(slots, pool.dtype) is None
    plain = TorchPagedAttention(use_kernels=False)
    plain.plan(*plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size)
    assert plain.decode_step(slots, pool.dtype) is None
    backend.plan(*plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size)
    assert torch.float16 not in cpu_kernels.DTYPES
    assert backend.decode_step(slots, torch.float16) is None


def test_a_plan_with_no_sequences_attends_nothing():
    """A step with no rows (every other step is planned too) plans no group and returns an
    empty output, on the decode-only shortcut's path as on the general one."""
    backend = TorchPagedAttention("cpu")
    empty, start = torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    backend.plan(
        start, start, empty, empty, num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4
    )
    out = backend.run(torch.zeros(0, 4, 16), torch.zeros(3, 2, 4, 2, 16))
    assert out.shape == (0, 4, 16)
