"""LoRA adapters on the engine: float32 greedy output of each adapter equals transformers +
peft on the same random weights (rank 8 and 64 on every projection, lora_B random), also with
8 adapters and the base batched together and with 2 slots forcing loads and evictions mid-run;
a row for an adapter that is not resident is refused with its event and counter, then served."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import ALL_PROJECTIONS, build_adapter, peft_greedy
from models import TINY_VOCAB, build_tiny_model

from mstar.engine.config import EngineConfig, parse_cli_args, to_cli_args
from mstar.engine.engine import LLMEngine
from mstar.engine.lora.adapter import AdapterError, LoraAdapter
from mstar.engine.lora.modules import LoraModule, parse_lora_module
from mstar.engine.lora.pool import LoraPool
from mstar.engine.sampling_params import InvalidParameter, SamplingParams

NEW_TOKENS = 12
#: (name, rank, targets, rslora): rank 8 and 64 on every projection, and narrower ones
ADAPTERS: list[tuple[str, int, list[str], bool]] = [
    ("r8", 8, ALL_PROJECTIONS, False),
    ("r64", 64, ALL_PROJECTIONS, False),
    ("attn", 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    ("mlp", 8, ["gate_proj", "up_proj", "down_proj"], False),
    ("qv", 4, ["q_proj", "v_proj"], True),
    ("down", 32, ["down_proj"], False),
    ("r8b", 8, ALL_PROJECTIONS, True),
    ("kup", 16, ["k_proj", "up_proj"], False),
]


#: (adapter or None, prompt, peft's greedy output)
Cases = list[tuple[str | None, list[int], list[int]]]


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.choice([2, 5, 9, 17]))]
            for _ in range(n)]  # fmt: skip


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        name: build_adapter(tiny_llama_dir, root / name, rank, seed, targets, rslora=rs)
        for seed, (name, rank, targets, rs) in enumerate(ADAPTERS, start=11)
    }


@pytest.fixture(scope="module")
def cases(tiny_llama_dir: Path, adapters: dict[str, Path]) -> Cases:
    """(adapter or None, prompt, peft's greedy output): each adapter and the base."""
    names: list[str | None] = [None, *adapters]
    prompts = _prompts(len(names))
    return [
        (name, prompt, peft_greedy(tiny_llama_dir, adapters.get(name or ""), prompt, NEW_TOKENS))
        for name, prompt in zip(names, prompts, strict=True)
    ]


def _engine(base: Path, adapters: dict[str, Path], **kw: Any) -> LLMEngine:
    cfg: dict[str, Any] = dict(
        model=str(base), dtype="float32", device="cpu", page_size=4, num_pages=512,
        lora_modules=[f"{n}={p}" for n, p in adapters.items()], max_lora_rank=64, max_loras=8,
    )  # fmt: skip
    cfg.update(kw)
    return LLMEngine.from_config(EngineConfig(**cfg))


def _greedy(name: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, lora_name=name)


def test_adapters_change_the_output(tiny_llama_dir: Path, cases: Cases) -> None:
    """The references are worth comparing against: on its prompt, each adapter moves peft's
    greedy output off the base model's."""
    for name, prompt, want in cases[1:]:
        assert want != peft_greedy(tiny_llama_dir, None, prompt, NEW_TOKENS), name


def test_each_adapter_alone_matches_peft(
    tiny_llama_dir: Path, adapters: dict[str, Path], cases: Cases
) -> None:
    engine = _engine(tiny_llama_dir, adapters)
    for name, prompt, want in cases:
        assert engine.generate([prompt], _greedy(name))[0] == want, name


def test_the_prefix_cache_never_shares_kv_across_adapters(
    tiny_llama_dir: Path, adapters: dict[str, Path], cases: Cases
) -> None:
    """Each prompt first runs on the base model (its pages enter the prefix cache), then with
    its adapter: the adapter's output is still peft's (its KV is its own, keyed from its own
    chain root), and a second run with the same adapter reuses its own pages."""
    engine = _engine(tiny_llama_dir, adapters)
    for name, prompt, want in cases[1:]:
        engine.generate([prompt], _greedy(None))
        hits = engine.kv.prefix_hits
        assert engine.generate([prompt], _greedy(name))[0] == want, name
        assert engine.kv.prefix_hits == hits, name  # nothing reused from the base's chain
        assert engine.generate([prompt], _greedy(name))[0] == want, name
        assert engine.kv.prefix_hits > hits or len(prompt) <= 4, name  # its own pages


def test_eight_adapters_and_base_in_one_batch(
    tiny_llama_dir: Path, adapters: dict[str, Path], cases: Cases
) -> None:
    engine = _engine(tiny_llama_dir, adapters)
    assert engine.lora is not None
    for name in adapters:  # every adapter resident first: then all 9 rows share steps
        engine.generate([[5]], SamplingParams(max_tokens=1, temperature=0.0, lora_name=name))
    rows = engine.lora.rows
    fused_step, fused = rows.fused_step, []

    def counted() -> Any:
        fused.append(rows.full is not None)
        return fused_step()

    rows.fused_step = counted  # type: ignore[method-assign]
    got = engine.generate([p for _, p, _ in cases], [_greedy(n) for n, _, _ in cases])
    assert got == [want for _, _, want in cases]
    assert engine.lora.pool.counters.evictions == 0
    if engine.decoder.cpu_kernels is not None:  # the decode steps kept the fused decode
        assert rows.decode is not None and fused and all(fused)


def test_two_slots_load_and_evict_mid_run(
    tiny_llama_dir: Path, adapters: dict[str, Path], cases: Cases
) -> None:
    engine = _engine(tiny_llama_dir, adapters, max_loras=2)
    assert engine.lora is not None
    twice = cases + cases[1:]  # each adapter asked for again after others took its slot
    got = engine.generate([p for _, p, _ in twice], [_greedy(n) for n, _, _ in twice])
    assert got == [want for _, _, want in twice]
    counters = engine.lora.pool.counters
    assert counters.loads >= len(adapters) and counters.evictions >= len(adapters) - 2
    assert counters.refusals["AdapterSlotsBusy"] > 0 and counters.refusals["AdapterLoading"] > 0
    assert not engine.lora.resource.pinned and not engine.lora.resource.adapter_of
    engine.kv.assert_pages_conserved()


def test_modules_file_is_served_and_loaded_before_the_engine_serves(
    tiny_llama_dir: Path, adapters: dict[str, Path], cases: Cases, tmp_path: Path
) -> None:
    """--lora-modules-file (what the operator mounts): every listed adapter is served and the
    first --max-loras are resident before the first request; one that cannot be served is a
    counted failure, the rest still served; an unreadable file fails the start."""
    listed = [{"name": n, "path": str(p)} for n, p in list(adapters.items())[:3]]
    listed.append({"name": "gone", "path": str(tmp_path / "nowhere")})
    path = tmp_path / "adapters.json"
    path.write_text(json.dumps(listed))
    engine = _engine(tiny_llama_dir, {}, lora_modules_file=str(path), max_loras=2)
    assert engine.lora is not None
    pool = engine.lora.pool
    assert pool.names() == [e["name"] for e in listed[:3]]
    assert list(pool.resident) == pool.names()[:2] and not pool.loading
    assert pool.counters.load_failures == 1 and pool.counters.loads == 2
    name, prompt, want = next(c for c in cases if c[0] == listed[0]["name"])
    assert engine.generate([prompt], _greedy(name))[0] == want
    path.write_text("{not json")
    with pytest.raises(ValueError, match="--lora-modules-file"):
        _engine(tiny_llama_dir, {}, lora_modules_file=str(path))


def test_missing_adapter_refused_then_served(
    tiny_llama_dir: Path, adapters: dict[str, Path], cases: Cases
) -> None:
    """The row is refused with a typed reason (event + counters) while its adapter loads on the
    worker, the base row beside it runs meanwhile, and it is served after the load."""
    engine = _engine(tiny_llama_dir, adapters)
    name, prompt, want = cases[1]
    base_prompt, base_want = cases[0][1], cases[0][2]
    engine.add_request("lora", prompt, _greedy(name))
    engine.add_request("base", base_prompt, _greedy(None))
    tokens: dict[str, list[int]] = {"lora": [], "base": []}
    events: list[Any] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            events += [(out.request_id, e) for e in out.events]
    assert tokens == {"lora": want, "base": base_want}
    refused = [e for rid, e in events if e.name == "admit_refused"]
    assert refused and all(e.attributes["reason"] == "AdapterLoading" for e in refused)
    assert {e.attributes["resource"] for e in refused} == {"adapter"}
    assert {rid for rid, e in events if e.name == "admit_refused"} == {"lora"}
    assert engine.counters.admit_failures == len(refused)
    assert engine.lora is not None and engine.lora.pool.counters.loads == 1


def test_unknown_adapter_and_bad_folders(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    engine = _engine(tiny_llama_dir, {"r8": adapters["r8"]}, max_lora_rank=16)
    with pytest.raises(InvalidParameter) as err:
        engine.add_request("x", [5, 6], _greedy("nope"))
    assert err.value.param == "model"
    assert engine.lora is not None
    pool = engine.lora.pool
    with pytest.raises(AdapterError, match="over --max-lora-rank 16"):
        pool.register("big", str(adapters["r64"]))
    with pytest.raises(AdapterError, match="does not exist"):
        pool.register("gone", str(tmp_path / "gone"))
    with pytest.raises(AdapterError, match="already loaded"):
        pool.register("r8", str(adapters["r8"]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no adapter_config"):
        pool.register("empty", str(tmp_path / "empty"))
    assert pool.names() == ["r8"]


def test_unload_while_running_finishes_then_frees(
    tiny_llama_dir: Path, adapters: dict[str, Path], cases: Cases
) -> None:
    engine = _engine(tiny_llama_dir, adapters)
    assert engine.lora is not None
    name, prompt, want = cases[1]
    assert name is not None
    engine.add_request("a", prompt, _greedy(name))
    out: list[int] = []
    while not engine.lora.resource.pinned:
        for o in engine.step():
            out += o.new_token_ids
    engine.lora.pool.unregister(name)
    while engine.has_unfinished_requests():
        for o in engine.step():
            out += o.new_token_ids
    assert out == want
    assert name not in engine.lora.pool.resident and len(engine.lora.pool.free) == 8


@pytest.mark.parametrize("family", ["qwen2", "phi3", "qwen3"])
def test_families_match_peft(family: str, tmp_path: Path) -> None:
    """Biases (Qwen2), q/k norms (Qwen3), and a fused checkpoint whose PEFT targets are its
    own qkv_proj / gate_up_proj (Phi-3)."""
    base = build_tiny_model(tmp_path / family, family)
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if family == "phi3" else None
    adapter = build_adapter(base, tmp_path / "a", 8, 5, targets)
    engine = _engine(base, {"a": adapter})
    prompt = _prompts(1, seed=9)[0]
    assert engine.generate([prompt], _greedy("a"))[0] == peft_greedy(
        base, adapter, prompt, NEW_TOKENS
    )


def test_bf16_serves_adapters(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    """bf16 slots and activations (the C++ kernel's other dtype where the kernels load): the
    adapter rows run, and their output differs from the base's on the same prompt."""
    engine = _engine(tiny_llama_dir, {"r64": adapters["r64"]}, dtype="bfloat16")
    assert engine.lora is not None
    assert next(iter(engine.lora.modules.values())).slices[0].a.dtype == torch.bfloat16
    prompts = _prompts(4, seed=5)
    lora = engine.generate(prompts, _greedy("r64"))
    base = engine.generate(prompts, _greedy(None))
    assert all(len(o) == NEW_TOKENS for o in lora) and lora != base


def test_lora_flags_round_trip_and_errors() -> None:
    """The operator renders the flags with `to_cli_args`; the engine parses them back."""
    args = ["--lora-modules", "a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}',
            "--max-loras", "4", "--max-lora-rank", "64"]  # fmt: skip
    config = parse_cli_args(args)
    assert config.lora_enabled and config.max_loras == 4 and config.max_lora_rank == 64
    assert [parse_lora_module(m) for m in config.lora_modules] == [
        LoraModule("a", "/x"),
        LoraModule("b", "/y", "m"),
    ]
    assert parse_cli_args(to_cli_args(config)) == config
    assert parse_cli_args(["--enable-lora"]).lora_enabled
    assert not parse_cli_args([]).lora_enabled
    for bad, flag in ((["--max-loras", "0"], "--max-loras"), (["--lora-modules", "x"], "NAME=PATH"),
                      (["--lora-modules", '{"name": 1}'], "'name' and 'path'")):  # fmt: skip
        with pytest.raises(ValueError, match=flag):
            parse_cli_args(bad)


def test_pool_evicts_the_least_recently_used_idle_adapter() -> None:
    """Slots like pages: an adapter pinned by an admitted request is never the victim; among
    idle ones the least recently pinned goes; with every slot pinned, no load starts."""
    written: list[tuple[int, str | None]] = []

    def read(name: str, path: str) -> LoraAdapter:
        return LoraAdapter(name, path, 1, 1.0, {})

    pool = LoraPool(2, read, lambda slot, a: written.append((slot, a.name if a else None)))
    for name in "abc":
        pool.register(name, f"/{name}")

    def load(name: str) -> None:
        assert pool.start_load(name)
        pool.wait_loads(10)
        assert pool.status(name) == "resident"

    load("a")
    load("b")
    assert pool.try_pin("a") and pool.try_pin("b")
    pool.unpin("b")  # b idle, a pinned
    pool.unpin("a")
    assert pool.try_pin("a")  # a used again: b is now the least recently used, and idle
    load("c")
    assert pool.status("b") == "absent" and pool.counters.evictions == 1
    assert written[-1] == (written[1][0], "c")  # c took b's slot
    assert pool.try_pin("c")
    assert not pool.start_load("b")  # a and c pinned: nothing to evict
    pool.unregister("a")  # pinned: its slot is freed when its last request ends
    assert pool.status("a") == "resident" and not pool.try_pin("a")
    pool.unpin("a")
    assert pool.status("a") == "absent" and pool.free
    pool.close()
