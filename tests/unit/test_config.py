"""EngineConfig is the flag contract between the CLI and the operator: round trips are lossless."""

from __future__ import annotations

import pytest

from mstar.engine.config import EngineConfig, parse_cli_args, to_cli_args


def test_defaults_render_no_flags_and_parse_back() -> None:
    assert to_cli_args(EngineConfig()) == []
    assert parse_cli_args([]) == EngineConfig()


def test_round_trip_every_kind_of_field() -> None:
    cfg = EngineConfig(
        model="/models/x",
        dtype="bfloat16",
        num_pages=512,
        page_size=32,
        max_num_seqs=8,
        max_model_len=4096,
        cuda_graph_batch_sizes=[1, 2, 4],
        enforce_eager=True,
        enable_prefix_caching=False,
        eviction_policy="priority",
        host_offload_gb=2.5,
        deterministic=True,
    )
    args = to_cli_args(cfg)
    assert "--no-enable-prefix-caching" in args and "--enforce-eager" in args
    assert "--deterministic" in args
    assert parse_cli_args(args) == cfg


def test_positional_model() -> None:
    assert parse_cli_args(["/m"]).model == "/m"


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"page_size": 0}, "--page-size"),
        ({"num_pages": 1}, "--num-pages"),
        ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization"),
        ({"eviction_policy": "random"}, "--eviction-policy"),
        ({"host_offload_gb": -1}, "--host-offload-gb"),
        ({"cuda_graph_batch_sizes": [0]}, "--cuda-graph-batch-sizes"),
    ],
)
def test_invalid_settings_name_their_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        EngineConfig(**kwargs)
