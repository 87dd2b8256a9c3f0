"""`decode_rows`, the numpy plan of a decode-only step, against the torch path it skips."""

from __future__ import annotations

import pytest
import torch
from paged_cases import decode_case

from mstar.kernels.paged_groups import decode_group
from mstar.kernels.paged_layout import decode_rows, validate_plan


@pytest.mark.parametrize("lens", [[1], [37], [16, 5, 64, 1, 33]])
def test_decode_rows_equal_validate_plan_and_decode_group(lens: list[int]) -> None:
    _, _, _, plan = decode_case(lens, page_size=16, heads=(2, 1, 8), seed=3, dtype=torch.float32)
    got = decode_rows(*plan, page_size=16)
    assert got is not None
    kv_lens, table = got
    _, want_lens = validate_plan(*plan, page_size=16)
    want = decode_group(plan[1].long(), plan[2].long(), want_lens, torch.device("cpu"))
    assert kv_lens.tolist() == lens == want_lens.tolist()
    assert table.dtype == kv_lens.dtype == torch.int64
    assert table.reshape(-1).tolist() == want.page_table.tolist()


def test_decode_rows_leave_other_steps_to_the_general_path() -> None:
    _, _, _, (qo, kvp, idx, last) = decode_case(
        [20, 3], page_size=16, heads=(2, 1, 8), seed=4, dtype=torch.float32
    )
    assert decode_rows(qo, kvp, idx, last, 16) is not None
    extend = torch.tensor([0, 2, 3], dtype=qo.dtype)  # a two-query row
    assert decode_rows(extend, kvp, idx, last, 16) is None
    assert decode_rows(qo, kvp, idx, last + 16, 16) is None  # a last page past the page size
    assert decode_rows(qo, kvp, idx[:1], last, 16) is None  # indptr past the indices
    assert decode_rows(qo[:1], kvp[:1], idx, last[:0], 16) is None  # no rows
