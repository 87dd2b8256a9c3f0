"""LoRA on the CUDA-graph decode path, run on CPU (issue 49).

`lora_add_masked` is what a captured decode graph replays; here it is checked against the
gathered torch form and the C++-free reference on mixed rows (base rows and padding included,
and after a slot is reloaded in place), and the engine's padded graph path
(``setup_graphs(capture=False)``: exactly the static-buffer forward a graph records, run eagerly)
must give peft's float32 greedy tokens for a batch mixing adapters and the base, and under a
two-slot pool that loads and evicts mid-run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import ALL_PROJECTIONS, build_adapter, peft_greedy
from models import TINY_VOCAB

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.lora.cuda_graph_lora import GraphLoraRows, lora_add_masked, row_slots
from mstar.engine.lora.layer import LoraSlice
from mstar.engine.lora.resource import LoraPlan
from mstar.engine.sampling_params import SamplingParams
from mstar.kernels.lora import lora_add_torch

NEW_TOKENS = 10
SIZES = (1, 2, 4, 8)
#: (name, rank, targets): full rank-8 and rank-64 adapters and an attention-only one
ADAPTERS: list[tuple[str, int, list[str]]] = [
    ("r8", 8, ALL_PROJECTIONS),
    ("r64", 64, ALL_PROJECTIONS),
    ("attn", 16, ["q_proj", "k_proj", "v_proj", "o_proj"]),
]


def _slice(slots: int, rank: int, cols_in: int, cols_out: int, seed: int) -> LoraSlice:
    piece = LoraSlice(slots, rank, cols_in, cols_out, 0, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    for s in range(slots):
        r = rank - 2 * s  # ranks below the pool's, as adapters of several ranks leave them
        a = torch.randn(r, cols_in, generator=gen)
        b = torch.randn(cols_out, r, generator=gen)
        piece.write(s, (a, b), 0.5 + s)
    return piece


def test_masked_update_equals_the_gathered_form_with_base_rows_and_a_reload() -> None:
    piece = _slice(4, 8, 24, 40, seed=1)
    x = torch.randn(9, 24, generator=torch.Generator().manual_seed(2))
    slots = torch.tensor([0, -1, 3, 3, 1, -1, 2, 0, -1])
    for _ in range(2):
        base = torch.randn(9, 56, generator=torch.Generator().manual_seed(3))
        want, got = base.clone(), base.clone()
        lora_add_torch(want, x, piece.a, piece.b, piece.scales, slots, 16)
        lora_add_masked(got, x, piece.a, piece.b, piece.scales, slots, 16)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[slots < 0], base[slots < 0])  # base rows untouched, exactly
        assert torch.equal(got[:, :16], base[:, :16]) and not torch.equal(got, base)
        # a load into slot 3 writes in place (the graph's pointers stay valid)
        pointer = piece.a.data_ptr()
        piece.write(3, (torch.randn(5, 24), torch.randn(40, 5)), 2.0)
        assert piece.a.data_ptr() == pointer


def test_row_slots_pad_with_the_base() -> None:
    assert row_slots(LoraPlan((1, 1, 1), (2, -1, 0)), 4) == [2, -1, 0, -1]
    assert row_slots(None, 2) == [-1, -1]
    with pytest.raises(ValueError, match="3 LoRA rows planned for a step of 2"):
        row_slots(LoraPlan((1, 2), (0, 1)), 2)


def test_graph_rows_bind_and_stage_per_slot() -> None:
    rows = GraphLoraRows(2, 8, torch.device("cpu"))
    rows.stage(1, 4, LoraPlan((1, 1), (3, -1)))
    assert rows.buffers[1].tolist() == [3, -1, -1, -1, -1, -1, -1, -1]
    assert rows.buffers[0].tolist() == [-1] * 8
    with rows.bound(1, 4):
        assert rows.current is not None and rows.current.data_ptr() == rows.buffers[1].data_ptr()
        assert rows.current.shape == (4,)
    assert rows.current is None


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-graph")
    return {
        name: build_adapter(tiny_llama_dir, root / name, rank, seed, targets)
        for seed, (name, rank, targets) in enumerate(ADAPTERS, start=31)
    }


#: (adapter or None, prompt, peft's greedy output)
Cases = list[tuple[str | None, list[int], list[int]]]


@pytest.fixture(scope="module")
def cases(tiny_llama_dir: Path, adapters: dict[str, Path]) -> Cases:
    names: list[str | None] = [None, *adapters, None, "r8"]
    prompts = [[3 + (i * 7 + j * 5) % (TINY_VOCAB - 3) for j in range(3 + 2 * i)]
               for i in range(len(names))]  # fmt: skip
    return [
        (name, prompt, peft_greedy(tiny_llama_dir, adapters.get(name or ""), prompt, NEW_TOKENS))
        for name, prompt in zip(names, prompts, strict=True)
    ]


def _graph_engine(base: Path, adapters: dict[str, Path], max_loras: int) -> LLMEngine:
    config = EngineConfig(
        model=str(base), dtype="float32", device="cpu", page_size=4, max_lora_rank=64,
        max_loras=max_loras, lora_modules=[f"{n}={p}" for n, p in adapters.items()],
    )  # fmt: skip
    engine = LLMEngine.from_config(config)
    runner = engine.model_runner
    assert runner.setup_graphs(SIZES, False, engine.max_model_len, capture=False) is None
    return engine


def _greedy(name: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, lora_name=name)


@pytest.mark.parametrize("max_loras", [3, 2])
def test_graph_path_with_adapters_matches_peft(
    tiny_llama_dir: Path, adapters: dict[str, Path], cases: Cases, max_loras: int
) -> None:
    """Adapters and the base in one batch on the padded graph path equal peft; with two slots
    for three adapters the pool loads and evicts mid-run and the tokens still equal peft."""
    engine = _graph_engine(tiny_llama_dir, adapters, max_loras)
    graphs, lora = engine.model_runner.graphs, engine.lora
    assert graphs is not None and graphs.lora is not None and lora is not None
    masked: list[int] = []
    real_add: Any = lora_add_masked

    def counted(*args: Any) -> None:
        masked.append(int((args[5] >= 0).sum()))
        real_add(*args)

    import mstar.engine.lora.layer as layer

    layer.lora_add_masked = counted  # type: ignore[assignment]
    try:
        got = engine.generate([p for _, p, _ in cases], [_greedy(n) for n, _, _ in cases])
    finally:
        layer.lora_add_masked = real_add
    assert got == [want for _, _, want in cases]
    assert graphs.eager_runs > 0 and graphs.lora.staged == graphs.eager_runs
    assert any(masked), "no graph step carried an adapter row"
    counters = lora.pool.counters
    if max_loras == 2:
        assert counters.evictions > 0 and counters.refusals["AdapterSlotsBusy"] > 0
    else:
        assert counters.evictions == 0
    engine.kv.assert_pages_conserved()
