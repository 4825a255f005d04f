"""Int8 linear layers: weights stored as int8 with one float32 scale per output channel.

Quantization is symmetric per output row: ``scale[o] = max_i |W[o, i]| / 127`` and
``W_int8 = round(W / scale)``, so ``W ~= W_int8 * scale[:, None]`` with an error of at
most ``scale / 2`` per element. Two schemes share the stored form:

* ``int8`` (weight-only): activations keep their precision; the product is
  ``x @ (W_int8 * scale).T``. Kernel per call, by device and row count: on the CPU
  ``lowbit_gemm.linear_int8`` (:mod:`cluster.kernels`) for up to its ``max_rows`` rows, on weights
  kept in its tiles only (:mod:`cluster.quant.lowbit_pack`), reading each byte once
  (SmolLM2-135M's linear layers at one row: 2.7 ms against 5.6 ms in bfloat16 through small_gemm
  and 5.2 ms through ``int8pack``, 2-core AVX-512 EPYC); elsewhere ``int8pack``
  (``torch.ops.aten._weight_int8pack_mm``, the int8-weight matmul torch ships for the CPU and
  other backends, fed 16-bit activations) for up to ``_PACK_MAX_ROWS`` rows; above those, where the
  matmul is compute-bound, ``widened``: ``_WIDEN_CHUNK`` output rows at a time are widened
  to the compute dtype (a slice small enough to stay in cache) and multiplied with
  ``F.linear``. ``widened`` alone is the correct fallback on any device.
* ``int8-dynamic`` (W8A8): activations are quantized per tensor on the fly and fbgemm's
  int8 GEMM runs (``torch.ops.quantized.linear_dynamic``); CPU with fbgemm only. The
  fastest kernel at every row count on a 2-core AVX2 CPU, but one scale per activation
  tensor loses the outlier channels: on SmolLM2-135M top-1 agreement with float32 fell
  to 62% and perplexity rose 171% (weight-only int8: 97.7%, +0.05%). A measured
  alternative, not a recommended setting.

`tandem bench quant` measures the kernels per shape and row count and the quality
of both schemes on the embedded default.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from cluster.kernels.build import lowbit_gemm
from cluster.quant.lowbit_pack import INT8_LINE, TILE_ROWS, pack_int8, unpack_int8

logger = logging.getLogger(__name__)

SCHEMES = ("int8", "int8-dynamic")
# At and below this many rows the int8pack kernel beats widening the weight. 2-core AVX2
# CPU, all linear layers of SmolLM2-135M (`tandem bench quant`): int8pack 12.8 / 19.5 / 64.4 ms
# at 1 / 4 / 16 rows against 21.8 / 24.1 / 42.9 ms for packed float32; widening 1024 output
# rows at a time is within 10-30% of float32 from 64 rows on, where int8pack is 1.5-2x slower.
_PACK_MAX_ROWS = 16
_WIDEN_CHUNK = 1024  # a multiple of the kernel's tile rows


class QuantizedWeight(NamedTuple):
    weight_int8: torch.Tensor  # [out_features, in_features] int8
    scale: torch.Tensor  # [out_features] float32


def quantize_weight(weight: torch.Tensor) -> QuantizedWeight:  # weight: [out_features, in_features]
    """Symmetric per-output-channel int8; an all-zero row gets scale 1 (and stays zero)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    weight_int8 = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(weight_int8, scale)


def dequantize_weight(q: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    return (q.weight_int8.float() * q.scale[:, None]).to(dtype)


class Int8Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held as int8 (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scheme: str = "int8") -> None:
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"quantization {scheme!r} is not supported; use one of {SCHEMES}")
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = weight.dtype
        self.scheme = scheme
        q = quantize_weight(weight)
        device = weight.device
        self._lowbit = (lowbit_gemm() if scheme == "int8" and device.type == "cpu" and self.in_features % INT8_LINE == 0
                        else None)
        # With the compiled kernel the weight is kept in its tiles only (weight_int8 unpacks it).
        self.register_buffer("_weight_int8", None if self._lowbit is not None else q.weight_int8)
        self.register_buffer("packed_int8", pack_int8(q.weight_int8) if self._lowbit is not None else None)
        self.register_buffer("weight_scale", q.scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._pack_dtype = None if self._lowbit is not None else int8pack_dtype(device.type, self.compute_dtype)
        # The int8pack kernel wants scales in the activation dtype.
        self._pack_scale = q.scale.to(self._pack_dtype) if self._pack_dtype is not None else None
        self._fbgemm = None
        if scheme == "int8-dynamic":
            if not fbgemm_available() or device.type != "cpu":
                raise ValueError("quantization 'int8-dynamic' needs fbgemm on the CPU; use 'int8' on this device")
            self._fbgemm = _fbgemm_pack(q, self.bias)

    @property
    def weight_int8(self) -> torch.Tensor:  # [out_features, in_features] int8
        return self._int8_rows(0, self.out_features)

    def _int8_rows(self, start: int, end: int) -> torch.Tensor:  # [end - start, in_features]; start % 4 == 0
        if self.packed_int8 is None:
            return self._weight_int8[start:end]
        return unpack_int8(self.packed_int8[start // TILE_ROWS:-(-end // TILE_ROWS)], end - start)

    @property
    def weight_bytes(self) -> int:
        stored = self.packed_int8 if self.packed_int8 is not None else self._weight_int8
        return stored.numel() + self.weight_scale.numel() * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        if self._lowbit is not None and 0 < x.shape[0] <= self._lowbit.max_rows and x.dtype in (
                torch.float32, torch.bfloat16):
            return self._lowbit.linear_int8(x.contiguous(), self.packed_int8, self.weight_scale, self.out_features,
                                            self.bias)
        if self._fbgemm is not None:
            out = torch.ops.quantized.linear_dynamic(x.float(), self._fbgemm, True)
            return out.to(x.dtype)
        if self._pack_dtype is not None and x.shape[0] <= _PACK_MAX_ROWS:
            out = torch.ops.aten._weight_int8pack_mm(x.to(self._pack_dtype), self.weight_int8, self._pack_scale)
            out = out.to(x.dtype)
            return out if self.bias is None else out + self.bias
        return self.widened(x)

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        """The product through widened weights (what runs above the int8pack row limit), ``_WIDEN_CHUNK``
        output rows at a time: never the whole matrix at once."""
        if self.out_features <= _WIDEN_CHUNK:
            weight = dequantize_weight(QuantizedWeight(self.weight_int8, self.weight_scale), x.dtype)
            return F.linear(x, weight, self.bias)
        out = x.new_empty(x.shape[0], self.out_features)
        for start in range(0, self.out_features, _WIDEN_CHUNK):
            end = min(start + _WIDEN_CHUNK, self.out_features)
            chunk = self._int8_rows(start, end).to(x.dtype).mul_(self.weight_scale[start:end, None].to(x.dtype))
            out[:, start:end] = F.linear(x, chunk, None if self.bias is None else self.bias[start:end])
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


@functools.lru_cache(maxsize=None)
def int8pack_dtype(device_type: str, compute_dtype: torch.dtype) -> torch.dtype | None:
    """The activation dtype for ``_weight_int8pack_mm`` on this device, or None when the
    kernel is missing or wrong there. float32 compute feeds it bfloat16 (its float32 path
    is 6x slower than plain float32 on AVX2). Probed once against the dequantized product."""
    dtype = compute_dtype if compute_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return None
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(64, 64, generator=gen).to(device_type)
        x = torch.randn(2, 64, generator=gen).to(device_type)
        q = quantize_weight(w)
        out = torch.ops.aten._weight_int8pack_mm(x.to(dtype), q.weight_int8, q.scale.to(dtype)).float()
        expected = F.linear(x, dequantize_weight(q, torch.float32))
    except (RuntimeError, NotImplementedError) as err:
        logger.info("no int8pack kernel for %s on %s (%s); int8 layers widen their weights", dtype, device_type, err)
        return None
    if not torch.allclose(out, expected, rtol=0.05, atol=0.05 * expected.abs().max().item()):
        logger.warning("the int8pack kernel disagrees with the dequantized product on %s; not using it", device_type)
        return None
    return dtype


@functools.lru_cache(maxsize=None)
def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_dynamic")


def _fbgemm_pack(q: QuantizedWeight, bias: torch.Tensor | None):
    """fbgemm's prepacked int8 weight (per-channel scales, zero points 0)."""
    zero_points = torch.zeros(q.scale.numel(), dtype=torch.long)
    with warnings.catch_warnings():  # torch marks its quantized tensors deprecated; fbgemm's packing needs one
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch._make_per_channel_quantized_tensor(q.weight_int8, q.scale.double(), zero_points, 0)
    return torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.float())
