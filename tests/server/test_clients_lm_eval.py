"""lm-evaluation-harness (pinned in the test extras) against the live server, unchanged and with
no tokenizer flag: `local-completions` finds `/tokenizer_info`, tokenizes through `/tokenize`,
scores a multiple-choice task with `echo` + `logprobs` and runs a generation task. The tasks
and their data are local files; the hub is switched off, so nothing leaves 127.0.0.1.

The tiny model is float32, so each choice's loglikelihood must equal transformers' log-softmax
summed over the choice's tokens.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from live_server import LiveServer, make_engine

DOCS = [
    {"question": "w10 w11 w12", "choices": ["w13 w14", "w15", "w16 w17 w18"], "answer": 1},
    {"question": "w20 w21", "choices": ["w22", "w23 w24"], "answer": 0},
    {"question": "w30 w31 w32 w33", "choices": ["w34", "w35", "w36"], "answer": 2},
]

TASKS = {
    "mstar_tiny_mc": """
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
""",
    "mstar_tiny_gen": """
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{choices[answer]}}"
generation_kwargs:
  until: ["w2"]
  max_gen_toks: 4
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, body in TASKS.items():
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        head += f"    test: {data}\ntest_split: test\n"
        (folder / f"{name}.yaml").write_text(head + body)
    return folder


@pytest.fixture(scope="module")
def live(tiny_chat_dir: Path) -> Iterator[LiveServer]:
    with LiveServer(make_engine(tiny_chat_dir)) as server:
        yield server


def _evaluate(live: LiveServer, task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model="local-completions",
        model_args=f"model=tiny,base_url={live.url}/v1/completions,num_concurrent=2",
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
    )


@functools.cache
def _hf_model(folder: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _hf_loglikelihood(folder: Path, context: list[int], continuation: list[int]) -> float:
    model = _hf_model(folder)
    ids = context + continuation
    with torch.inference_mode():
        lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    start = len(context)
    return sum(float(lp[p - 1, ids[p]]) for p in range(start, len(ids)))


def test_lm_eval_scores_and_generates_with_no_tokenizer_flag(
    live: LiveServer, task_dir: Path, tiny_chat_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _evaluate(live, task_dir, monkeypatch)
    assert set(result["results"]) == set(TASKS)
    assert 0.0 <= result["results"]["mstar_tiny_mc"]["acc,none"] <= 1.0
    samples = result["samples"]["mstar_tiny_mc"]
    assert len(samples) == len(DOCS)
    for sample in samples:
        doc = sample["doc"]
        context = [int(w[1:]) for w in doc["question"].split()]
        for choice, resp in zip(doc["choices"], sample["filtered_resps"], strict=True):
            loglikelihood, _greedy = resp
            continuation = [int(w[1:]) for w in choice.split()]
            want = _hf_loglikelihood(tiny_chat_dir, context, continuation)
            assert loglikelihood == pytest.approx(want, abs=1e-4)
    generated = result["samples"]["mstar_tiny_gen"]
    assert len(generated) == len(DOCS)
    assert all(isinstance(s["resps"][0][0], str) for s in generated)
    # lm-eval took the remote tokenizer: /tokenizer_info answered in vLLM's shape
    status, body = live.get("/tokenizer_info")
    info = json.loads(body)
    assert status == 200 and info["eos_token"] == "w2" and info["model_max_length"] > 0
