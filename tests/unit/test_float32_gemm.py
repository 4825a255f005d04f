"""bfloat16 linear layers computed in float32 arithmetic (widening_gemm) from the row count where
this CPU does that faster than oneDNN's bfloat16 GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cluster.kernels import float32_gemm, packed_linear
from cluster.kernels.build import small_gemm, widening_gemm
from cluster.kernels.packed_linear import SMALL_GEMM_MAX_ROWS, PackedLinear, can_pack, pack_linears

CPU = torch.device("cpu")
needs_both = pytest.mark.skipif(not (can_pack(CPU, torch.bfloat16) and widening_gemm() is not None),
                                reason="oneDNN packs no bfloat16 weights or widening_gemm did not build on this CPU")


@pytest.fixture()
def probe_says(monkeypatch):
    """Makes the probe report the given speedup (or raise) instead of timing this CPU."""
    def install(speedup):
        def fake_probe():
            if isinstance(speedup, Exception):
                raise speedup
            return speedup
        monkeypatch.setattr(float32_gemm, "_probe", fake_probe)
        monkeypatch.setattr(float32_gemm, "widening_gemm", lambda: object())  # as if it built here
        float32_gemm.float32_gemm_min_rows.cache_clear()
    yield install
    float32_gemm.float32_gemm_min_rows.cache_clear()


@pytest.mark.parametrize("speedup, expected", [
    (1.4, float32_gemm.FLOAT32_FROM_ROWS),  # the Xeon: float32 ahead from about ten rows
    (1.05, None),  # too small a lead
    (0.6, None),  # bfloat16 faster (AMX, AMD)
    (RuntimeError("no bfloat16 path"), None),
])
def test_float32_is_taken_from_its_row_count_only_where_the_probe_finds_it_ahead(probe_says, speedup, expected):
    probe_says(speedup)
    assert float32_gemm.float32_gemm_min_rows() == expected


def test_no_float32_rows_without_the_widening_kernel(monkeypatch, probe_says):
    probe_says(2.0)
    monkeypatch.setattr(float32_gemm, "widening_gemm", lambda: None)
    assert float32_gemm.float32_gemm_min_rows() is None


@needs_both
def test_the_probe_runs_on_this_cpu_and_gives_a_speedup():
    assert 0 < float32_gemm._probe() < 100


def _bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 summation error over K terms plus a bfloat16 rounding of the output."""
    magnitude = x.double().abs() @ weight.double().abs().T
    return magnitude * (x.shape[1] * torch.finfo(torch.float32).eps + torch.finfo(torch.bfloat16).eps) + 1e-6


@needs_both
def test_rows_from_the_crossover_on_take_the_widened_copy_and_stay_exact_to_bfloat16():
    torch.manual_seed(0)
    linear = torch.nn.Linear(192, 200).to(torch.bfloat16)
    layer = PackedLinear(linear, float32_from_rows=24)
    assert layer.float32_from_rows == 24 and layer.widened_weight is not None
    assert layer.float32_bias.dtype == torch.float32
    for rows in (1, SMALL_GEMM_MAX_ROWS[torch.bfloat16] + 1, 23, 24, 100):
        x = torch.randn(rows, 192).to(torch.bfloat16)
        y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 200)
        expected = x.double() @ linear.weight.double().T + linear.bias.double()
        assert ((y.double() - expected).abs() <= _bound(x, linear.weight)).all(), rows
    # Which rows read the widened copy: swap in the copy of another weight.
    other = torch.nn.Linear(192, 200).to(torch.bfloat16)
    layer.widened_weight = widening_gemm().pack(other.weight.detach())
    for rows, reads_copy in ((23, False), (24, True), (64, True)):
        x = torch.randn(rows, 192).to(torch.bfloat16)
        reference = F.linear(x.float(), (other if reads_copy else linear).weight.float())
        torch.testing.assert_close(layer(x).float() - linear.bias.float(), reference, rtol=2e-2, atol=2e-2)


@needs_both
def test_the_few_row_kernel_keeps_its_rows_and_float32_layers_get_no_copy():
    layer = PackedLinear(torch.nn.Linear(192, 64, bias=False).to(torch.bfloat16), float32_from_rows=2)
    assert layer.float32_from_rows == max(2, layer.small_max_rows + 1)  # small_gemm, where it built, keeps its rows
    assert layer.float32_bias is None
    plain = PackedLinear(torch.nn.Linear(192, 64), float32_from_rows=2)
    assert plain.float32_from_rows is None and plain.widened_weight is None


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64)


@needs_both
@pytest.mark.parametrize("dtype, batch_invariant, probed, expected", [
    (torch.bfloat16, False, 48, 48),
    (torch.bfloat16, False, None, None),  # the probe found no lead
    (torch.bfloat16, True, 48, None),  # small_gemm takes every row
    (torch.float32, False, 48, None),
])
def test_pack_linears_gives_every_layer_the_probed_crossover(monkeypatch, dtype, batch_invariant, probed, expected):
    if batch_invariant and small_gemm() is None:
        pytest.skip("batch-invariant layers need the compiled small_gemm kernel")
    monkeypatch.setattr(packed_linear, "float32_gemm_min_rows", lambda: probed)
    model = _TwoLayers().to(dtype)
    assert pack_linears(model, CPU, dtype, batch_invariant) == 2
    for layer in (model.up, model.down):
        assert isinstance(layer, PackedLinear)
        assert layer.float32_from_rows == expected
        assert (layer.widened_weight is not None) == (expected is not None)


def test_turned_off_by_the_environment(monkeypatch, probe_says):
    probe_says(2.0)
    monkeypatch.setenv("TANDEM_FLOAT32_GEMM", "0")
    assert float32_gemm.float32_gemm_min_rows() is None
