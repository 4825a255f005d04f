"""The few-row CPU GEMM (cluster/kernels/small_gemm.cpp) against float64 matmuls."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cluster.kernels import build
from cluster.kernels.packed_linear import SMALL_GEMM_MAX_ROWS, PackedLinear


@pytest.fixture(scope="module")
def kernel():
    module = build.small_gemm()
    if module is None:
        # Where the CPU has the vectors the kernel needs, failing to build it is a bug, not a skip.
        assert not build.cpu_has_vectors() or not build.kernels_enabled(), "small_gemm did not build on this CPU"
        pytest.skip("small_gemm is not available on this CPU")
    return module


def _bound(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-output error allowed: float32 summation error over K terms, plus half a unit
    in the last place of the output dtype."""
    magnitude = x.double().abs() @ weight.double().abs().T  # [rows, N]
    eps_out = torch.finfo(out_dtype).eps
    return magnitude * (x.shape[1] * torch.finfo(torch.float32).eps) + magnitude * eps_out


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_every_row_count_and_a_partial_tile_match_float64(kernel, weight_dtype, x_dtype):
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 64):
        for out_features, in_features in ((64, 96), (37, 64), (130, 576)):
            weight = torch.randn(out_features, in_features, generator=gen).to(weight_dtype)
            x = torch.randn(rows, in_features, generator=gen).to(x_dtype)
            bias = torch.randn(out_features, generator=gen)
            y = kernel.linear(x, kernel.pack(weight), out_features, bias)
            assert y.shape == (rows, out_features) and y.dtype == x_dtype
            expected = x.double() @ weight.double().T + bias.double()
            error = (y.double() - expected).abs()
            assert (error <= _bound(x, weight, x_dtype) + 1e-6).all(), (rows, out_features, error.max())


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_whatever_the_row_count(kernel, weight_dtype, x_dtype):
    # What keeps speculation's greedy output exact at batch 1 (and model.batch_invariant exact
    # everywhere): a verified row's logits equal the ones plain decoding computed alone.
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(37, 576, generator=gen).to(weight_dtype)
    packed = kernel.pack(weight)
    x = torch.randn(64, 576, generator=gen).to(x_dtype)
    together = kernel.linear(x, packed, 37, None)
    for rows in (1, 2, 3, 5, 8, 13):
        assert torch.equal(kernel.linear(x[:rows].contiguous(), packed, 37, None), together[:rows]), rows
    assert torch.equal(kernel.linear(x[50:51].contiguous(), packed, 37, None), together[50:51])


def test_no_bias_and_the_pack_pads_rows_with_zeros(kernel):
    weight = torch.randn(6, 32)
    packed = kernel.pack(weight)
    assert packed.shape == (2, 2, 4, 16)  # 2 tiles of 4 rows, 2 cache lines of 16 floats
    assert packed[1, :, 2:].abs().sum() == 0  # rows 6 and 7 do not exist
    x = torch.randn(3, 32)
    torch.testing.assert_close(kernel.linear(x, packed, 6, None), x @ weight.T, rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_with_a_reason(kernel):
    packed = kernel.pack(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="rows"):
        kernel.linear(torch.randn(kernel.max_rows + 1, 64), packed, 8, None)
    with pytest.raises(RuntimeError, match="features"):
        kernel.linear(torch.randn(2, 32), packed, 8, None)
    with pytest.raises(RuntimeError, match="out_features"):
        kernel.linear(torch.randn(2, 64), packed, 12, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.linear(torch.randn(2, 64).double(), packed, 8, None)
    with pytest.raises(RuntimeError, match="multiple of"):
        kernel.pack(torch.randn(8, 40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_takes_the_kernel_for_few_rows_and_matches_f_linear_at_every_size(kernel, dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(192, 200).to(dtype)
    packed = PackedLinear(linear)
    assert packed.small_max_rows == SMALL_GEMM_MAX_ROWS[dtype]
    calls = []
    real = packed._kernel

    class Spy:  # counts the kernel's calls, computes with the real one
        def linear(self, *args):
            calls.append(args[0].shape[0])
            return real.linear(*args)

    packed._kernel = Spy()
    for rows in (1, 3, SMALL_GEMM_MAX_ROWS[dtype], SMALL_GEMM_MAX_ROWS[dtype] + 1, 33):
        x = torch.randn(rows, 192).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), rtol=tol, atol=tol)
    assert calls == [1, 3, SMALL_GEMM_MAX_ROWS[dtype]]


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    assert not build.kernels_enabled()
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "1")
    assert build.kernels_enabled()


def test_each_torch_installation_keeps_its_own_build():
    """Two environments with the same torch version in different places (the project's venv and
    the vLLM tier's) must not share a build folder: torch's builder would rebuild in turn."""
    source = build._SOURCE_DIR / "small_gemm.cpp"
    here = build.build_key(source, Path("/venv-a/torch"))
    assert here == build.build_key(source, Path("/venv-a/torch"))
    assert here != build.build_key(source, Path("/venv-b/torch"))
    assert here != build.build_key(build._SOURCE_DIR / "decode_ops.cpp", Path("/venv-a/torch"))


def test_a_build_lock_left_by_a_killed_build_does_not_block_the_next_start(tmp_path):
    """A process killed while torch's builder held its lock file left it behind, and every later
    engine start waited on it without a word. A fresh process must load past it (in a
    subprocess: a hang shows as its timeout)."""
    import subprocess
    import sys

    if not build.cpu_has_vectors() or not build.kernels_enabled():
        pytest.skip("no kernels on this CPU")
    assert build.small_gemm() is not None  # built (or loaded) once, so the folder exists
    _, folder = build._build_dir("small_gemm", build._SOURCE_DIR / "small_gemm.cpp")
    (folder / "lock").write_text("")  # torch's baton, as a killed build leaves it
    code = "from cluster.kernels import build; assert build.small_gemm() is not None"
    done = subprocess.run([sys.executable, "-c", code], timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (folder / "lock").exists()
