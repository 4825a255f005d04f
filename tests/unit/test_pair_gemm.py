"""pair_gemm: bfloat16 linear layers on the CPU's pair product, checked against float64 matmuls, and
the probe that gives it the rows small_gemm does not take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cluster.kernels import packed_linear, pair_products
from cluster.kernels.build import pair_gemm
from cluster.kernels.packed_linear import PackedLinear, can_pack, pack_linears

CPU = torch.device("cpu")
kernel = pair_gemm()
needs_kernel = pytest.mark.skipif(kernel is None, reason="pair_gemm needs AVX-512-BF16 and a compiler")
needs_both = pytest.mark.skipif(kernel is None or not can_pack(CPU, torch.bfloat16),
                                reason="pair_gemm did not build or oneDNN packs no bfloat16 weights on this CPU")


def _bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 summation error over K terms plus one rounding of the output to bfloat16."""
    magnitude = x.double().abs() @ weight.double().abs().T
    return magnitude * (x.shape[1] * torch.finfo(torch.float32).eps) + 2 * torch.finfo(torch.bfloat16).eps * (
        magnitude + 1.0)


@needs_kernel
@pytest.mark.parametrize("out_features, in_features", [(32, 64), (200, 192), (49, 576), (1, 16), (960, 576)])
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 25, 64])
def test_every_row_and_output_matches_the_float64_product(out_features, in_features, rows):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    packed = kernel.pack(weight)
    assert packed.shape == ((out_features + 31) // 32, in_features // 2, 64) and packed.dtype == torch.bfloat16
    expected = x.double() @ weight.double().T + bias.double()
    y = kernel.linear(x, packed, out_features, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    assert ((y.double() - expected).abs() <= _bound(x, weight)).all()
    no_bias = kernel.linear(x, packed, out_features, None)
    assert ((no_bias.double() - (expected - bias.double())).abs() <= _bound(x, weight)).all()
    # a strided x (a view of every other row) reads the same rows
    wide = torch.zeros(2 * rows, in_features, dtype=torch.bfloat16)
    wide[::2] = x
    assert torch.equal(kernel.linear(wide[::2], packed, out_features, bias), y)


@needs_kernel
def test_a_row_gets_the_same_bits_alone_or_beside_any_other_rows():
    """What lets the kernel take batch-1 decoding and its verification steps: plain decoding's row
    and the same row among k drafted ones come out bit for bit alike."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(200, 576, generator=generator).to(torch.bfloat16)
    packed = kernel.pack(weight)
    x = torch.randn(40, 576, generator=generator).to(torch.bfloat16)
    alone = torch.cat([kernel.linear(x[i:i + 1], packed, 200, None) for i in range(40)])
    for rows in (2, 9, 13, 25, 40):
        assert torch.equal(kernel.linear(x[:rows], packed, 200, None), alone[:rows]), rows


@needs_kernel
def test_rounding_to_bfloat16_is_torchs_nearest_even_and_keeps_inf_and_nan():
    weight = torch.eye(32, dtype=torch.bfloat16)
    x = torch.tensor([1.5, -2.25, 3.3e38, -3.3e38] + [0.0] * 28).to(torch.bfloat16)[None, :]
    assert torch.equal(kernel.linear(x, kernel.pack(weight), 32, None), x)  # the identity keeps x
    doubled = kernel.linear(x, kernel.pack(2 * weight), 32, None)
    assert doubled[0, 0] == 3.0 and doubled[0, 2] == float("inf") and doubled[0, 3] == float("-inf")
    # the float32 sum (x plus a bias between bfloat16 numbers) rounded once, as torch rounds it
    bias = torch.full((32,), 2 ** -9)
    with_bias = kernel.linear(x[:, :2].repeat(1, 16), kernel.pack(weight), 32, bias)
    assert torch.equal(with_bias, (x[:, :2].repeat(1, 16).float() + bias).to(torch.bfloat16))
    nan = kernel.linear(torch.full((1, 32), float("nan")).to(torch.bfloat16), kernel.pack(weight), 32, None)
    assert torch.isnan(nan.float()).all()


@needs_kernel
def test_bad_input_is_refused_with_what_was_wrong():
    packed = kernel.pack(torch.randn(40, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel.pack(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="even"):
        kernel.pack(torch.randn(40, 63).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel.linear(torch.randn(3, 64), packed, 40, None)
    with pytest.raises(RuntimeError, match="features"):
        kernel.linear(torch.randn(3, 32).to(torch.bfloat16), packed, 40, None)
    with pytest.raises(RuntimeError, match="out_features"):
        kernel.linear(torch.randn(3, 64).to(torch.bfloat16), packed, 80, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.linear(torch.randn(3, 64).to(torch.bfloat16), packed, 40, torch.zeros(39))
    assert kernel.linear(torch.randn(0, 64).to(torch.bfloat16), packed, 40, None).shape == (0, 40)


@pytest.fixture()
def probe_says(monkeypatch):
    """Makes the probe report the given speedups at few and many rows (or raise) instead of timing this CPU."""
    def install(speedups):
        def fake_probe():
            if isinstance(speedups, Exception):
                raise speedups
            return speedups
        monkeypatch.setattr(pair_products, "_probe", fake_probe)
        monkeypatch.setattr(pair_products, "pair_gemm", lambda: object())  # as if it built here
        monkeypatch.setattr(pair_products, "float32_gemm_min_rows", lambda: None)
        pair_products.pair_gemm_wins.cache_clear()
        pair_products.pair_gemm_takes_few_rows.cache_clear()
    yield install
    pair_products.pair_gemm_wins.cache_clear()
    pair_products.pair_gemm_takes_few_rows.cache_clear()


@pytest.mark.parametrize("speedups, expected", [
    ((1.24, 1.04), True),  # Zen 4: ahead at 32 rows, level at 256
    ((1.02, 1.2), False),  # too small a lead where it counts
    ((1.3, 0.8), False),  # behind on many rows: prefill would pay
    ((0.3, 0.2), False),  # AMX: oneDNN far ahead
    (RuntimeError("no bfloat16 path"), False),
])
def test_the_pair_kernel_is_taken_only_where_the_probe_finds_it_ahead(probe_says, speedups, expected):
    probe_says(speedups)
    assert pair_products.pair_gemm_wins() is expected


def test_no_pair_kernel_where_float32_won_it_is_missing_or_turned_off(monkeypatch, probe_says):
    probe_says((2.0, 2.0))
    monkeypatch.setattr(pair_products, "float32_gemm_min_rows", lambda: 10)
    assert pair_products.pair_gemm_wins() is False
    probe_says((2.0, 2.0))
    monkeypatch.setattr(pair_products, "pair_gemm", lambda: None)
    assert pair_products.pair_gemm_wins() is False
    probe_says((2.0, 2.0))
    monkeypatch.setenv("TANDEM_PAIR_GEMM", "0")
    assert pair_products.pair_gemm_wins() is False


@pytest.mark.parametrize("speedups, expected", [
    ((1.27, 1.44), True),  # Zen 4: small_gemm reads the weights slower
    ((0.9, 1.3), False),  # small_gemm ahead at batch 1
    ((1.2, 0.95), False),
])
def test_every_row_goes_to_the_pair_kernel_only_where_it_beats_small_gemm_too(monkeypatch, probe_says, speedups,
                                                                              expected):
    probe_says((1.3, 1.0))
    monkeypatch.setattr(pair_products, "small_gemm", lambda: object())
    monkeypatch.setattr(pair_products, "_probe_few", lambda: speedups)
    assert pair_products.pair_gemm_takes_few_rows() is expected
    probe_says((1.0, 1.0))  # the pair kernel not taken at all: not for few rows either
    monkeypatch.setattr(pair_products, "_probe_few", lambda: (2.0, 2.0))
    assert pair_products.pair_gemm_takes_few_rows() is False


@needs_both
def test_the_probes_run_on_this_cpu_and_give_speedups():
    few, many = pair_products._probe()
    assert 0 < few < 100 and 0 < many < 100
    one, eight = pair_products._probe_few()
    assert 0 < one < 100 and 0 < eight < 100


@needs_both
def test_rows_past_small_gemm_take_the_pair_copy_and_stay_exact_to_bfloat16():
    torch.manual_seed(0)
    linear = torch.nn.Linear(192, 200).to(torch.bfloat16)
    layer = PackedLinear(linear, pair_from_rows=10)
    assert layer.pair_weight is not None and layer.packed_weight is None and layer.plain_weight is None
    assert layer.pair_from_rows == layer.small_max_rows + 1
    assert layer.pair_bias.dtype == torch.float32
    for rows in (1, layer.small_max_rows, layer.small_max_rows + 1, 100):
        x = torch.randn(rows, 192).to(torch.bfloat16)
        y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 200)
        expected = x.double() @ linear.weight.double().T + linear.bias.double()
        assert ((y.double() - expected).abs() <= _bound(x, linear.weight)).all(), rows
    # Which rows read the pair copy: swap in the copy of another weight.
    other = torch.nn.Linear(192, 200).to(torch.bfloat16)
    layer.pair_weight = kernel.pack(other.weight.detach())
    for rows, reads_copy in ((layer.small_max_rows, False), (layer.small_max_rows + 1, True), (64, True)):
        x = torch.randn(rows, 192).to(torch.bfloat16)
        reference = F.linear(x.float(), (other if reads_copy else linear).weight.float())
        torch.testing.assert_close(layer(x).float() - linear.bias.float(), reference, rtol=2e-2, atol=2e-2)


@needs_both
def test_from_one_row_the_pair_kernel_takes_every_call_and_small_gemm_keeps_no_copy():
    torch.manual_seed(1)
    linear = torch.nn.Linear(192, 200).to(torch.bfloat16)
    layer = PackedLinear(linear, pair_from_rows=1)
    assert layer.pair_from_rows == 1 and layer.small_max_rows == 0 and layer.small_gemm_weight is None
    assert layer.packed_weight is None and layer.plain_weight is None
    x = torch.randn(12, 192).to(torch.bfloat16)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(12)])
    assert torch.equal(layer(x), alone)  # batch-1 verification reproduces plain decoding
    expected = x.double() @ linear.weight.double().T + linear.bias.double()
    assert ((alone.double() - expected).abs() <= _bound(x, linear.weight)).all()


@needs_both
def test_only_bfloat16_layers_of_even_width_that_are_not_batch_invariant_get_the_pair_copy():
    assert PackedLinear(torch.nn.Linear(192, 64), pair_from_rows=1).pair_weight is None  # float32
    odd = PackedLinear(torch.nn.Linear(63, 64).to(torch.bfloat16), pair_from_rows=1)
    assert odd.pair_weight is None and odd.pair_from_rows is None and odd.packed_weight is not None
    invariant = PackedLinear(torch.nn.Linear(192, 64).to(torch.bfloat16), batch_invariant=True, pair_from_rows=1)
    assert invariant.pair_weight is None and invariant.small_gemm_weight is not None
    widening = PackedLinear(torch.nn.Linear(192, 64).to(torch.bfloat16), float32_from_rows=10, pair_from_rows=1)
    assert widening.pair_weight is None


@needs_both
@pytest.mark.parametrize("wins, few_rows", [(True, True), (True, False), (False, False)])
def test_pack_linears_follows_the_probes(monkeypatch, wins, few_rows):
    monkeypatch.setattr(packed_linear, "pair_gemm_wins", lambda: wins)
    monkeypatch.setattr(packed_linear, "pair_gemm_takes_few_rows", lambda: few_rows)
    monkeypatch.setattr(packed_linear, "float32_compute_rows", lambda *args, **kwargs: None)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)).to(torch.bfloat16)
    x = torch.randn(40, 64).to(torch.bfloat16)
    expected = model(x)
    assert pack_linears(model, CPU, torch.bfloat16) == 2
    for layer in model:
        assert (layer.pair_weight is not None) is wins and (layer.packed_weight is None) is wins
        assert (layer.small_gemm_weight is None) is few_rows and (layer.pair_from_rows == 1) is few_rows
    torch.testing.assert_close(model(x), expected, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(model(x[:1]), expected[:1], rtol=3e-2, atol=3e-2)
