"""The probe that decides how many rows bfloat16 layers give small_gemm: its decision from measured
times (the timing itself is never asserted), its floor, and the layers it reaches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cluster.kernels import packed_linear, small_rows
from cluster.kernels.build import small_gemm
from cluster.kernels.packed_linear import PackedLinear, can_pack, pack_linears

needs_kernel = pytest.mark.skipif(small_gemm() is None or not can_pack(torch.device("cpu"), torch.bfloat16),
                                  reason="needs the compiled small_gemm and oneDNN's bfloat16 path")


@pytest.fixture(autouse=True)
def fresh_probe():
    small_rows.small_gemm_max_rows.cache_clear()
    yield
    small_rows.small_gemm_max_rows.cache_clear()


@needs_kernel
@pytest.mark.parametrize("times, expected", [
    ({10: (1, 2), 12: (1, 2), 16: (3, 2)}, 12),  # slower first at 16: keeps 12
    ({10: (1, 2), 12: (1, 2), 16: (1, 2)}, 16),
    ({10: (3, 2), 12: (1, 2), 16: (1, 2)}, 9),  # slower at the first candidate: the floor
    ({10: (2, 2), 12: (3, 2), 16: (1, 2)}, 10),  # a tie keeps small_gemm; later wins do not count
])
def test_small_gemm_keeps_the_candidates_up_to_the_first_it_loses(monkeypatch, times, expected):
    monkeypatch.setattr(small_rows, "_probe", lambda: times)
    assert small_rows.small_gemm_max_rows(torch.bfloat16) == expected


def test_float32_and_the_switch_keep_the_floor(monkeypatch):
    monkeypatch.setattr(small_rows, "_probe", lambda: pytest.fail("probed"))
    assert small_rows.small_gemm_max_rows(torch.float32) == 8
    monkeypatch.setenv("TANDEM_SMALL_GEMM_PROBE", "0")
    assert small_rows.small_gemm_max_rows(torch.bfloat16) == 9


@needs_kernel
def test_the_probe_measures_every_candidate_and_layers_take_its_rows(monkeypatch):
    times = small_rows._probe()
    assert sorted(times) == list(small_rows.CANDIDATE_ROWS)
    assert all(s > 0 and o > 0 for s, o in times.values())
    monkeypatch.setattr(small_rows, "_probe", lambda: {10: (1, 2), 12: (1, 2), 16: (3, 2)})
    # where the pair kernel beats small_gemm at every row (pair_products), small_gemm would keep none
    monkeypatch.setattr(packed_linear, "pair_gemm_takes_few_rows", lambda: False)
    model = nn.Sequential(nn.Linear(64, 32)).to(torch.bfloat16)
    assert pack_linears(model, torch.device("cpu"), torch.bfloat16) == 1
    layer = model[0]
    assert isinstance(layer, PackedLinear) and layer.small_max_rows == 12
    calls = []
    real = layer._small_gemm
    layer._small_gemm = lambda x: calls.append(x.shape[0]) or real(x)
    x = torch.randn(16, 64).to(torch.bfloat16)
    for rows in (1, 12, 13):
        out = layer(x[:rows])
        assert out.shape == (rows, 32)
    assert calls == [1, 12]  # 13 rows went to the next kernel
