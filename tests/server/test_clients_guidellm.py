"""guidellm (pinned in the test extras) against the live server, with no tokenizer and no model
flag: it validates the backend (`/health`, `/v1/models`), takes the served model, and runs a
short synchronous and a concurrent profile over a local prompt file, streaming chat
completions. The hub is switched off, so nothing leaves 127.0.0.1.

guidellm's synthetic data is left out: guidellm builds it with `AutoTokenizer.from_pretrained`
of the served model id and asks the server nothing, so only a served id that is a local folder
(vLLM's default, the model path) avoids `--tokenizer` there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from live_server import LiveServer, make_engine

#: One prompt a request (guidellm stops when the file runs out).
PROMPTS = [
    "w10 w11 w12 w13",
    "w20 w21",
    "w30 w31 w32",
    "w40",
    "w50 w51 w52 w53 w54",
]


@pytest.fixture(scope="module")
def live(tiny_chat_dir: Path) -> Iterator[LiveServer]:
    with LiveServer(make_engine(tiny_chat_dir)) as server:
        yield server


def _guidellm(live: LiveServer, tmp_path: Path, profile: str, requests: int) -> dict[str, Any]:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "report.json"
    binary = shutil.which("guidellm")
    assert binary is not None, "guidellm is in the test extras"
    cmd = [
        binary, "run",
        "--backend", f"kind=openai_http,target={live.url}",
        "--profile", profile,
        "--constraint", f"kind=max_requests,count={requests}",
        "--data", f"kind=json_file,path={data}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    ("profile", "requests"),
    [("kind=synchronous", 4), ("kind=concurrent,streams=3", 5)],
)
def test_guidellm_profiles_run_with_no_tokenizer_flag(
    live: LiveServer, tmp_path: Path, profile: str, requests: int
) -> None:
    before = live.metric("mstar:request_success_total", finished_reason="length")
    before += live.metric("mstar:request_success_total", finished_reason="stop")
    report = _guidellm(live, tmp_path, profile, requests)
    (bench,) = report["benchmarks"]
    state = bench["scheduler_state"]
    assert state["successful_requests"] == requests
    assert state["errored_requests"] == 0
    metrics = bench["metrics"]
    assert metrics["output_token_count"]["successful"]["mean"] > 0
    assert metrics["time_to_first_token_ms"]["successful"]["mean"] > 0
    after = live.metric("mstar:request_success_total", finished_reason="length")
    after += live.metric("mstar:request_success_total", finished_reason="stop")
    assert after - before >= requests  # guidellm may send warm-up requests too
