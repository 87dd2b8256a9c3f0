"""The step message rank 0 broadcasts to the other ranks before each forward: plain data only
(token ids, the KV plan's page tables and write slots, the rows whose logits are wanted).

Every rank then plans its own attention and positions from the same KV plan over its own KV
pool (same page numbers, its own heads), so admission, page allocation, prefix sharing and
sampling stay on rank 0. Two broadcasts per step on the control group: a fixed header of
sizes, then one int64 payload of every array.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mstar.engine.parallel.group import RankGroup
from mstar.engine.resources.kv.plan import KVPlan

#: header: op, tokens, rows, main page indices, logits rows, is_decode, page_size, KV groups
_HEADER = 8
_STOP, _STEP = 0, 1


def _plan_parts(kv: KVPlan) -> list[torch.Tensor]:
    return [
        kv.qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, kv.seq_lens,
        kv.prefix_lens, kv.write_slots,
    ]  # fmt: skip


class StepChannel:
    """Rank 0 `send`s each step (and `stop` at the end); the others `recv` it."""

    def __init__(self, group: RankGroup, device: torch.device) -> None:
        self.group = group.control
        self.device = device
        #: bytes rank 0 sent and broadcasts it made (the README's communication figures)
        self.bytes_sent = 0
        self.calls = 0

    def _bcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, 0, group=self.group)
        self.bytes_sent += t.numel() * t.element_size()
        self.calls += 1

    def send(self, input_ids: torch.Tensor, kv: KVPlan, index: torch.Tensor) -> None:
        """Broadcast one step (rank 0, right before its own forward). A hybrid model's other
        KV groups (`KVPlan.groups`, same rows) follow the main plan in the payload; their
        page counts take one more broadcast, sent only when there are such groups."""
        parts = [input_ids, index]
        for plan in (kv, *kv.groups):
            parts += _plan_parts(plan)
        rows = len(kv.request_ids)
        header = [_STEP, kv.num_tokens, rows, kv.kv_indices.numel(), index.numel()]
        header += [int(kv.is_decode), kv.page_size, len(kv.groups)]
        self._bcast(torch.tensor(header, dtype=torch.int64))
        if kv.groups:
            self._bcast(torch.tensor([g.kv_indices.numel() for g in kv.groups]))
        self._bcast(torch.cat([p.to("cpu", torch.int64).reshape(-1) for p in parts]))

    def stop(self) -> None:
        """Tell the other ranks to leave their loop."""
        self._bcast(torch.zeros(_HEADER, dtype=torch.int64))

    def recv(self) -> tuple[torch.Tensor, KVPlan, torch.Tensor] | None:
        """The next step as (input ids, KV plan, logits rows); None when rank 0 stops."""
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        op, tokens, rows, pages, n_index, is_decode, page_size, n_groups = header.tolist()
        if op == _STOP:
            return None
        counts = [pages]
        if n_groups:
            more = torch.empty(n_groups, dtype=torch.int64)
            dist.broadcast(more, 0, group=self.group)
            counts += more.tolist()
        per_plan = [[rows + 1, rows + 1, n, rows, rows, rows, tokens] for n in counts]
        sizes = [tokens, n_index] + [size for plan in per_plan for size in plan]
        payload = torch.empty(sum(sizes), dtype=torch.int64)
        dist.broadcast(payload, 0, group=self.group)
        ids, index, *arrays = payload.split(sizes)
        i32 = torch.int32
        plans = []
        for g in range(len(counts)):
            qo, kvp, idx, last, seq, prefix, slots = arrays[7 * g : 7 * g + 7]
            plan = KVPlan(
                request_ids=("",) * rows,
                qo_indptr=qo.to(i32),
                kv_indptr=kvp.to(i32),
                kv_indices=idx.to(i32),
                kv_last_page_len=last.to(i32),
                seq_lens=seq.to(i32),
                prefix_lens=prefix.to(i32),
                write_slots=slots.to(self.device),
                num_tokens=tokens,
                is_decode=bool(is_decode),
                page_size=page_size,
            )
            plans.append(plan)
        main = plans[0]._replace(groups=tuple(plans[1:]))
        return ids.to(self.device), main, index.to(self.device)
