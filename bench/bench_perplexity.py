"""Mean negative log-likelihood of a fixed held-out text: mstar's engine against llama.cpp's
``llama-perplexity``, on the same GGUF file and the same windows.

Text: two sections ("execmodel", "import") of the Python Language Reference as Python 3.11.7
ships them (``pydoc_data.topics``, PSF license): 4,266 SmolLM2 tokens of English prose
with some grammar, written after the model's data was gathered; its sha256 is checked so
every run scores the same text.

Files: the default model's own Q4_1 file, and llama-quantize ``--allow-requantize --pure``
copies of it in each served type (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K: every tensor that type where its
rows allow, llama.cpp's fallback where they do not; the table says each file's share of weights
per type) and F32, the unquantized reference. The Q4_1 file is SmolLM2's only copy here, so it is
the source: its F32 copy holds exactly its values, and quantizing that gives byte-identical files
(checked), so no higher-precision source exists to be honest about. ``--gemma`` adds Gemma 3
270M's Q4_K_M file as it ships (a real K-quant mixture).

Windows as llama-perplexity cuts them (tools/perplexity, ``perplexity()``): the text tokenized
once (BOS first where the vocabulary adds one), cut into ``--ctx``-token windows (the tail
dropped), each window's first token replaced by BOS where the vocabulary adds one, and only its
second half scored: the logits at positions ctx/2 .. ctx-2 predict tokens ctx/2+1 .. ctx-1.
mstar scores a window as one request's prompt logprobs (`SamplingParams.prompt_logprobs`).

    flock /tmp/mstar-heavy.lock python bench/bench_perplexity.py [--ctx 512] \\
        [--types F32,Q8_0,Q4_0,Q4_1,Q4_K,Q5_K,Q6_K] [--dtypes float32,bfloat16] [--chunks N] \\
        [--gemma]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.model.gguf_convert import find_packaged_gguf
from mstar.engine.sampling_params import SamplingParams

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_all import llama_cpp_bin, machine, requantized  # noqa: E402  (bench/ is a folder of scripts, not a package)

sys.path.insert(0, str(HERE.parent / "tests"))
from models import gemma3_270m_gguf  # noqa: E402  (the Gemma package's file, assembled once)

SECTIONS = ("execmodel", "import")
TEXT_SHA256 = "bd8f80db2b2aba0fa06da36259f6bffa58b372773e91c2534161ff8f91dacae4"
#: the packaged file's own type: scored as shipped, not requantized
PACKAGED = "Q4_1"
#: the row name of Gemma 3 270M's own file (``--gemma``)
GEMMA = "Gemma 3 270M Q4_K_M"


def held_out_text() -> str:
    """The fixed text (sections joined by blank lines); SystemExit when this Python's copy
    differs from the one the README's figures were measured on."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[s].strip() for s in SECTIONS) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()
    if digest != TEXT_SHA256:
        raise SystemExit(f"held-out text changed (sha256 {digest}); this Python is not 3.11.7?")
    return text


def windows(tokens: Sequence[int], ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's windows: whole ``ctx``-token slices, the first token BOS if given."""
    out = []
    for i in range(len(tokens) // ctx):
        window = list(tokens[i * ctx : (i + 1) * ctx])
        if bos is not None:
            window[0] = bos
        out.append(window)
    return out


def mstar_nll(engine: LLMEngine, wins: list[list[int]]) -> tuple[float, int]:
    """Summed NLL over each window's scored half, and the count, through ``engine``."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    ids = [f"ppl-{i}" for i in range(len(wins))]
    for rid, window in zip(ids, wins, strict=True):
        engine.add_request(rid, window, params)
    scores: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                scores[out.request_id] = [s.logprob for s in out.prompt_logprobs]
    total, count = 0.0, 0
    for rid, window in zip(ids, wins, strict=True):
        first = len(window) // 2
        # prompt_logprobs[p] scores token p + 1 from the logits at position p
        scored = scores[rid][first : len(window) - 1]
        total -= sum(scored)
        count += len(scored)
    return total, count


def mstar_engine(path: Path, dtype: str, quantization: str, tokens: int) -> LLMEngine:
    """An engine with KV pages for ``tokens`` at once (every window in one batch)."""
    pages = tokens // 16 + 64
    config = EngineConfig(
        model=str(path), dtype=dtype, device="cpu", quantization=quantization, num_pages=pages,
        seed=0, enable_prefix_caching=False,
    )  # fmt: skip
    return LLMEngine.from_config(config)


def llama_tokens(path: Path, text_file: Path) -> list[int]:
    """llama.cpp's own tokenization of the text (``llama-tokenize``), BOS as perplexity adds it."""
    cmd = [str(llama_cpp_bin() / "llama-tokenize"), "-m", str(path), "-f", str(text_file)]
    cmd += ["--ids", "--log-disable"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [int(t) for t in re.findall(r"-?\d+", out.strip().splitlines()[-1])]


def llama_nll(path: Path, text_file: Path, ctx: int, chunks: int) -> tuple[float, int]:
    """llama-perplexity's mean NLL (the log of its final PPL) over its first ``chunks``
    windows (-1: all), and how many windows it scored."""
    cmd = [str(llama_cpp_bin() / "llama-perplexity"), "-m", str(path), "-f", str(text_file)]
    cmd += ["-c", str(ctx), "-b", str(ctx), "-t", str(os.cpu_count()), "--chunks", str(chunks)]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    log = res.stdout + res.stderr
    ppl = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    scored = re.search(r"calculating perplexity over (\d+) chunks", log)
    if ppl is None or scored is None:
        raise SystemExit(f"llama-perplexity gave no estimate:\n{log[-2000:]}")
    return math.log(float(ppl.group(1))), int(scored.group(1))


def model_file(qtype: str) -> Path:
    if qtype == GEMMA:
        return gemma3_270m_gguf()
    return find_packaged_gguf() if qtype == PACKAGED else requantized(qtype, pure=qtype != "F32")


def census(path: Path) -> str:
    """The file's matrices by type, as shares of their weights ("Q4_K 20%, Q5_0 80%")."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        if len(t.shape) > 1:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    total = sum(counts.values())
    top = sorted(counts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {n / total:.0%}" for name, n in top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=-1, help="the first N windows (-1: all)")
    parser.add_argument("--types", default="F32,Q8_0,Q4_0,Q4_1,Q4_K,Q5_K,Q6_K")
    parser.add_argument("--gemma", action="store_true", help="Gemma 3 270M's own Q4_K_M too")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="mstar's activations")
    args = parser.parse_args()
    text = held_out_text()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        text_file = Path(tmp) / "heldout.txt"
        text_file.write_text(text)
        for qtype in args.types.split(",") + ([GEMMA] if args.gemma else []):
            path = model_file(qtype)
            theirs, chunks = llama_nll(path, text_file, args.ctx, args.chunks)
            for dtype in args.dtypes.split(","):
                quantization = "none" if qtype == "F32" else "auto"
                engine = mstar_engine(path, dtype, quantization, len(text))  # >= its tokens
                tok = engine.tokenizer
                add_bos = tok.encode("", add_special_tokens=True) != []
                bos = engine.model_config.bos_token_id if add_bos else None
                tokens = tok.encode(text, add_special_tokens=True)
                same = tokens == llama_tokens(path, text_file)
                wins = windows(tokens, args.ctx, bos)[: args.chunks if args.chunks > 0 else None]
                if len(wins) != chunks:
                    raise SystemExit(f"{qtype}: {len(wins)} windows, llama-perplexity {chunks}")
                total, count = mstar_nll(engine, wins)
                ours = total / count
                rows.append((qtype, census(path), dtype, ours, theirs, count, same))
                print(f"{qtype} {dtype}: mstar {ours:.4f} llama.cpp {theirs:.4f} "
                      f"({ours / theirs - 1:+.2%}), {count} tokens, same tokens {same}",
                      flush=True)  # fmt: skip
                del engine
    print(f"\n{machine()}; ctx {args.ctx}; load {os.getloadavg()[0]:.2f}\n")
    print("| file | weights by type | mstar activations | scored tokens | mstar NLL "
          "| llama.cpp NLL | mstar / llama.cpp |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|")
    for qtype, types, dtype, ours, theirs, count, same in rows:
        note = "" if same else " (tokens differ from llama-tokenize)"
        print(f"| {qtype}{note} | {types} | {dtype} | {count} | {ours:.4f} | {theirs:.4f} "
              f"| {ours / theirs:.4f} |")  # fmt: skip


if __name__ == "__main__":
    main()
