"""A worker rank of a tensor-parallel replica: its shard of the model and of the KV pool, and
a loop that runs each step rank 0 broadcasts until rank 0 says stop.

A worker holds no scheduler, tokenizer state, sampler or HTTP server: every decision is rank
0's. It plans its own attention and positions from rank 0's KV plan (the same page numbers
over its own heads' pool) and runs the same forward, whose collectives join rank 0's.

``python -m mstar.engine.parallel.worker`` is how rank 0 (or a non-leader pod's process,
`serve_node`) starts one on its node; it exits 0 when told to stop, 1 when the replica broke.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

from mstar.engine.batch import DECODE_WALK
from mstar.engine.config import EngineConfig
from mstar.engine.engine import _pick_device, _pick_dtype
from mstar.engine.model.gguf_convert import default_model
from mstar.engine.model.loader import load_model
from mstar.engine.parallel.channel import StepChannel
from mstar.engine.parallel.group import (
    Layout,
    LocalWorkers,
    check_devices,
    join_group,
    watch_parent,
)
from mstar.engine.rank_resources import attention_resource, kv_pages, rank_kv_config
from mstar.engine.resource_keys import KV
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.positions import PositionsResource
from mstar.engine.resources.step import ResourceStep, StepContext

log = logging.getLogger(__name__)


def run_worker(config: EngineConfig, rank: int, address: str) -> int:
    """Join as ``rank``, load this rank's shard, run steps until told to stop."""
    device = _pick_device(config.device)
    dtype = _pick_dtype(config.dtype, device)
    group = join_group(rank, Layout.of(config), address, device)
    try:
        decoder, model_config, _ = load_model(
            default_model(config.model),
            dtype=dtype,
            device=device,
            deterministic=config.deterministic,
            quantization=config.quantization,
            tp=group.tp,
        )
        local = decoder.config
        pages = group.agree_min(kv_pages(config, model_config, device, dtype)[0])
        cache = KVCache(rank_kv_config(local, config, pages, dtype, device))
        attention = attention_resource(cache, local, config, device, dtype)
        positions = PositionsResource(device)
        channel = StepChannel(group, device)
        log.info("rank %d: %d KV pages of %d KV heads; waiting for steps", rank, pages,
                 local.num_kv_heads)  # fmt: skip
        while (step := channel.recv()) is not None:
            input_ids, plan, index = step
            ctx = StepContext([], DECODE_WALK, 0, False)
            ctx.plan_results[KV] = plan
            with torch.inference_mode():
                pos = positions.plan(ResourceStep(), ctx)
                decoder(input_ids, pos, attention.plan(ResourceStep(), ctx), index)
    except Exception:
        log.exception("rank %d failed: this replica is down", rank)
        return 1
    group.leave()
    log.info("rank %d: stopped", rank)
    return 0


def serve_node(config: EngineConfig) -> int:
    """A non-leader pod (``--node-rank`` above 0): start this node's other ranks, run its
    first one here; the pod's exit status is this rank's."""
    layout = Layout.of(config)
    assert config.dist_init_addr is not None  # validated with --nnodes above 1
    check_devices(layout, _pick_device(config.device))  # before starting any process
    first = layout.first_rank
    workers = None
    if layout.per_node > 1:
        workers = LocalWorkers(config, range(first + 1, first + layout.per_node),
                               config.dist_init_addr)  # fmt: skip
    code = run_worker(config, first, config.dist_init_addr)
    if workers is not None:
        if code:
            workers.kill()
        else:
            workers.close()
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One worker rank of a tensor-parallel replica.")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--address", required=True, help="HOST:PORT where the ranks meet")
    parser.add_argument("--parent", type=int, required=True, help="exit when this pid is gone")
    parser.add_argument("--config", required=True, help="the EngineConfig, as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    watch_parent(args.parent)
    return run_worker(EngineConfig(**json.loads(args.config)), args.rank, args.address)


if __name__ == "__main__":
    sys.exit(main())
