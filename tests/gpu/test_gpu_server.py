"""The real server on CUDA (skipped without it): bf16, FlashInfer, CUDA graphs, the `openai`
client, as `mstar-engine serve --device cuda` runs on a GPU pod.

One greedy request must return exactly what the same engine gives offline (both run it alone, so
the same kernels on the same batches); eight concurrent streams must each get all their tokens;
afterwards no KV page stays in use and the probes answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from cuda_testing import build_hd64_llama, needs_cuda, needs_flashinfer
from live_server import LiveServer, add_chat_template, make_engine

from mstar.engine.sampling_params import SamplingParams

pytestmark = [needs_cuda, needs_flashinfer]

GPU = dict(
    device="cuda",
    dtype="bfloat16",
    attention_backend="flashinfer",
    cuda_graph_batch_sizes=[1, 2, 4, 8],
    host_offload_gb=0.0,
)
NEW = 16


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_chat_template(build_hd64_llama(tmp_path_factory.mktemp("gpu-chat")))


@pytest.fixture(scope="module")
def server(chat_dir: Path) -> Iterator[LiveServer]:
    with LiveServer(make_engine(chat_dir, **GPU)) as live:
        yield live


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_greedy_completion_equals_the_offline_engine(server: LiveServer, chat_dir: Path) -> None:
    prompt = [5, 9, 14, 22, 31]
    offline = make_engine(chat_dir, **GPU)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    want = list(offline.generate([prompt], params)[0])
    out = _client(server).completions.create(
        model="tiny",
        prompt=" ".join(f"w{i}" for i in prompt),
        max_tokens=NEW,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert [int(w[1:]) for w in out.choices[0].text.split()] == want
    assert out.usage is not None and out.usage.completion_tokens == NEW


def test_concurrent_streams_get_every_token_and_free_the_cache(server: LiveServer) -> None:
    client = _client(server)

    def stream(i: int) -> tuple[int, str | None]:
        chunks = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": " ".join(f"w{7 + i + j}" for j in range(4 + i))}],
            max_tokens=NEW,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        reason, used = None, 0
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        return used, reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(stream, range(8)))
    assert results == [(NEW, "length")] * 8
    server.wait_metric("mstar:kv_cache_usage_perc", 0.0)
    status, body = server.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
