"""Tensor parallelism in the model: one rank's shard of the weights and the collectives that
join the shards, slotted in through the linear seam (`linear.LinearMethod`) so no family file
changes.

A rank builds its decoder from `TPShard.local_config` (its KV heads with their query heads,
its slice of the MLP's intermediate rows, its slice of the vocabulary) and loads it through
`TPShard.picker`, which slices each checkpoint tensor as the projection's `LinearSpec.parallel`
says and wraps the runtime module:

- column ("qkv_proj", "gate_up_proj"): this rank's output rows of every fused part, no
  communication;
- row ("o_proj", "down_proj"): this rank's input columns; the partial products are summed by
  one all-reduce (`RowParallelLinear`); the bias is loaded on rank 0 only, so it is added once;
- the LM head: this rank's vocabulary rows, gathered to rank 0 (`GatherLogits`);
- the embedding (`VocabParallelEmbedding`): this rank's vocabulary rows, zeros for ids outside
  them, one all-reduce.

KV heads split in contiguous groups (uneven where they do not divide: SmolLM2's 3 KV heads
over 2 ranks are 2 + 1), each with its query heads; the vocabulary is padded to a multiple of
the ranks so every rank's logits have one width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mstar.engine.model.config import ModelConfig, ModelLoadError
from mstar.engine.model.linear import LinearMethod, LinearSpec, MethodPicker

__all__ = [
    "GatherLogits",
    "RowParallelLinear",
    "TPRank",
    "TPShard",
    "VocabParallelEmbedding",
    "page_kv_heads",
    "split",
]


@dataclass(frozen=True)
class TPRank:
    """This process's place in a tensor-parallel replica: its rank of ``size`` and the process
    group its in-step collectives run on (None only in single-process unit checks)."""

    rank: int
    size: int
    group: Any = None


def split(n: int, size: int, rank: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s share of ``n`` items in contiguous blocks, the first
    ``n % size`` ranks taking one more."""
    base, extra = divmod(n, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def tp_refusal(cfg: ModelConfig, size: int) -> str | None:
    """Why ``cfg`` cannot be sharded over ``size`` ranks (None: it can)."""
    if cfg.moe is not None:
        return "MoE experts are not sharded under tensor parallelism yet (serve it on one rank)"
    if cfg.num_kv_heads < size:
        return (
            f"{cfg.num_kv_heads} KV heads cannot be split over {size} ranks "
            "(KV-head replication is not implemented)"
        )
    if cfg.intermediate_size < size or cfg.vocab_size < size:
        return f"the model is too small to split over {size} ranks"
    return None


def page_kv_heads(cfg: ModelConfig, size: int) -> int:
    """The KV heads a page is sized by on every rank: the most any rank holds, so the page
    count from one memory budget (the capacity rank 0 admits against) is the same on all."""
    return -(-cfg.num_kv_heads // size)


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``size`` of the model ``cfg``: which heads, MLP rows and vocabulary
    rows it holds, and the group its collectives run on."""

    rank: int
    size: int
    cfg: ModelConfig
    group: Any = None

    @classmethod
    def of(cls, tp: TPRank, cfg: ModelConfig) -> TPShard:
        return cls(tp.rank, tp.size, cfg, tp.group)

    def __post_init__(self) -> None:
        why = tp_refusal(self.cfg, self.size)
        if why is not None:
            raise ModelLoadError(f"--tensor-parallel-size {self.size}: {why}")

    @property
    def kv_heads(self) -> tuple[int, int]:
        return split(self.cfg.num_kv_heads, self.size, self.rank)

    @property
    def q_heads(self) -> tuple[int, int]:
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        start, n = self.kv_heads
        return start * group, n * group

    @property
    def inter(self) -> tuple[int, int]:
        return split(self.cfg.intermediate_size, self.size, self.rank)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.cfg.vocab_size // self.size)

    @property
    def vocab(self) -> tuple[int, int]:
        """(first row, rows of the real vocabulary) this rank holds (the rest is padding)."""
        start = self.rank * self.vocab_per_rank
        return start, max(0, min(self.vocab_per_rank, self.cfg.vocab_size - start))

    def local_config(self) -> ModelConfig:
        """The config this rank's decoder is built from."""
        return dataclasses.replace(
            self.cfg,
            num_heads=self.q_heads[1],
            num_kv_heads=self.kv_heads[1],
            intermediate_size=self.inter[1],
            vocab_size=self.vocab_per_rank,
        )

    def offsets(self, spec: LinearSpec) -> list[int]:
        """Where this rank's slice of each checkpoint tensor of ``spec`` starts (output rows
        for column-parallel, input columns for row-parallel)."""
        d = self.cfg.head_dim
        kind = spec.name.rpartition(".")[2]
        table = {
            "qkv_proj": [self.q_heads[0] * d, self.kv_heads[0] * d, self.kv_heads[0] * d],
            "gate_up_proj": [self.inter[0], self.inter[0]],
            "o_proj": [self.q_heads[0] * d],
            "down_proj": [self.inter[0]],
            "lm_head": [self.vocab[0]],
        }
        if kind not in table:
            raise ModelLoadError(f"no tensor-parallel split for projection {spec.name!r}")
        return table[kind]

    def vocab_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary rows of an embedding / LM head tensor, zero-padded."""
        start, n = self.vocab
        rows = tensor[start : start + n]
        pad = self.vocab_per_rank - n
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])])
        return rows

    def picker(self, inner: MethodPicker) -> MethodPicker:
        """``inner``'s methods, each sliced and wrapped for this rank."""

        def pick(spec: LinearSpec) -> LinearMethod:
            return TPLinearMethod(inner(spec), self, spec)

        return pick

    def shard_embedding(self, embedding: nn.Embedding) -> VocabParallelEmbedding:
        start, n = self.vocab
        return VocabParallelEmbedding(embedding.weight, start, n, self.group)


class TPLinearMethod:
    """Another method's projection, loaded with this rank's slice and run with the collective
    its `LinearSpec.parallel` needs."""

    def __init__(self, inner: LinearMethod, shard: TPShard, spec: LinearSpec) -> None:
        self.inner = inner
        self.shard = shard
        self.spec = spec

    def create(self, spec: LinearSpec, dtype: torch.dtype, device: torch.device) -> nn.Module:
        return self.inner.create(spec, dtype, device)

    def load(self, module: nn.Module, kind: str, tensors: Sequence[torch.Tensor]) -> None:
        self.inner.load(module, kind, self._slice(kind, tensors))

    def _slice(self, kind: str, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        spec, shard = self.spec, self.shard
        if spec.name == "lm_head":
            return [shard.vocab_rows(t) for t in tensors]
        offsets = shard.offsets(spec)
        if spec.parallel == "row":
            if kind == "bias":  # added once, after the sum: rank 0 holds it
                return [t if shard.rank == 0 else torch.zeros_like(t) for t in tensors]
            width = spec.in_features
            return [t[:, off : off + width] for t, off in zip(tensors, offsets, strict=True)]
        widths = spec.parts or (spec.out_features,)
        return [t[off : off + w] for t, off, w in zip(tensors, offsets, widths, strict=True)]

    def finalize(self, spec: LinearSpec, module: nn.Module) -> nn.Module:
        inner = self.inner.finalize(spec, module)
        if spec.name == "lm_head":
            return GatherLogits(inner, self.shard)
        if spec.parallel == "row":
            return RowParallelLinear(inner, self.shard.group)
        return inner


class RowParallelLinear(nn.Module):
    """A row-parallel projection: this rank's partial product, summed over the ranks."""

    def __init__(self, inner: nn.Module, group: Any) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner.forward(x)
        dist.all_reduce(out, group=self.group)
        return out


class GatherLogits(nn.Module):
    """The LM head's vocabulary slice on every rank, gathered into rank 0's full logits
    (the other ranks return their slice, which nothing reads)."""

    def __init__(self, inner: nn.Module, shard: TPShard) -> None:
        super().__init__()
        self.inner = inner
        self.rank = shard.rank
        self.size = shard.size
        self.vocab_size = shard.cfg.vocab_size
        self.group = shard.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local: torch.Tensor = self.inner.forward(x).contiguous()
        if self.rank != 0:
            dist.gather(local, None, dst=0, group=self.group)
            return local
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.gather(local, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``start .. start + n`` of the embedding; other ids read zeros, and one all-reduce
    leaves every rank with every token's row (a sum of one row and zeros: exact). The loaded
    rows stay where they are (an LM head tied to them reads the same storage)."""

    def __init__(self, weight: torch.Tensor, start: int, n: int, group: Any) -> None:
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True)
        self.start = start
        self.n = n
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.n)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(out, group=self.group)
        return out
