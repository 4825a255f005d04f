"""The batch-size -> k table a vLLM group installs means, in vLLM's own reading of it (its dense
lookup, ``build_dynamic_sd_schedule_lookup``), the k Tandem's table controller picks at every
batch size: one profile, one k per batch size, whichever engine runs it."""

from __future__ import annotations

import pytest

from cluster.spec_decode.controller import BatchState, TableController
from cluster.spec_decode.profile_data import batch_size_ranges


@pytest.mark.parametrize("table", [{1: 4, 4: 3, 16: 1}, {8: 2}, {2: 5, 3: 4, 64: 0}, {1: 6, 32: 2}])
def test_vllm_reads_the_ranges_as_the_native_table(table):
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    max_batch, max_k = 96, max(table.values()) or 1
    lookup = build_dynamic_sd_schedule_lookup(batch_size_ranges(table), max_batch, max_k)
    native = TableController(table)
    assert [lookup[b] for b in range(1, max_batch + 1)] == [
        min(max_k, native.choose_k(BatchState(b, 0))) for b in range(1, max_batch + 1)]
