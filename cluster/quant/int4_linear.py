"""4-bit linear layers: weight-only, asymmetric, one float16 scale and offset per group of inputs.

Each row of W is cut into groups of ``GROUP_SIZE`` consecutive inputs; a group keeps a float16
``scale`` and ``offset`` and codes ``q = round((W - offset) / scale)`` in [0, 15], so
``W ~= q * scale + offset``. The pair starts at the group's range (``scale = (max - min) / 15``,
``offset = min``: every weight within ``scale / 2``) and is then refitted by least squares to the
codes it gives, ``REFITS`` times, each group keeping the pair of least squared error (on
SmolLM2-135M's first six layers that lowers the weights' squared error by 20%).
That is 4.5 bits a weight at groups of 64. Groups of 64 differ on purpose from GGUF's Q4_1 (groups
of 32, the same asymmetric form): the embedded SmolLM2's bfloat16 weights *are* its Q4_1 weights
widened, so a Q4_1-shaped draft of it would reproduce the target almost exactly, which no real
bfloat16 target allows; 64-input groups quantize it as they would any other model.

Kernel per call: ``lowbit_gemm.linear_int4`` (:mod:`cluster.kernels`) for up to its ``max_rows``
rows on the CPU, reading the packed codes once (0.56 bytes a weight; SmolLM2-135M's linear layers
take 2.0 ms at one row on a 2-core EPYC, bound by unpacking the codes more than by memory); above that, and on other devices, ``TILES_PER_CHUNK`` tiles of rows at a time are
widened to the compute dtype and multiplied with ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cluster.kernels.build import lowbit_gemm
from cluster.quant.lowbit_pack import INT4_RUN, TILE_ROWS, pack_int4, unpack_int4

GROUP_SIZE = 64
REFITS = 4
TILES_PER_CHUNK = 256  # 1024 output rows widened at a time: never the whole matrix


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE, refits: int = REFITS
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] uint8 in [0, 15], scale [N, K / G], offset [N, K / G]), scale and
    offset float32 holding float16 values. A constant group gets scale 1 and codes 0."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"4-bit groups of {group_size} do not divide in_features {in_features}")
    w = weight.detach().float().view(out_features, in_features // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale, offset = _as_pair((high - low) / 15, low)
    q, error = _codes(w, scale, offset)
    for _ in range(refits):
        # least squares of w on q within each group: w ~= scale * q + offset
        qf = q.float()
        q_mean, w_mean = qf.mean(-1), w.mean(-1)
        q_var = (qf * qf).mean(-1) - q_mean * q_mean
        fitted = ((qf * w).mean(-1) - q_mean * w_mean) / q_var.clamp_min(1e-12)
        new_scale, new_offset = _as_pair(torch.where(q_var > 0, fitted, scale), w_mean - fitted * q_mean)
        new_offset = torch.where(q_var > 0, new_offset, offset)
        new_q, new_error = _codes(w, new_scale, new_offset)
        better = new_error < error
        scale, offset = torch.where(better, new_scale, scale), torch.where(better, new_offset, offset)
        q, error = torch.where(better[..., None], new_q, q), torch.minimum(new_error, error)
    return q.view(out_features, in_features), scale, offset


def _as_pair(scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rounded to float16 values; a scale that is not positive becomes 1 (a constant group)."""
    scale = scale.half().float()
    return torch.where(scale > 0, scale, torch.ones_like(scale)), offset.half().float()


def _codes(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes of each group under (scale, offset), and the group's squared error."""
    q = torch.round((w - offset[..., None]) / scale[..., None]).clamp_(0, 15)
    error = (q * scale[..., None] + offset[..., None] - w).square().sum(-1)
    return q.to(torch.uint8), error


class Int4Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held as 4-bit codes (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int = GROUP_SIZE) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if group_size % INT4_RUN or self.in_features % group_size:
            raise ValueError(f"int4 needs in_features ({self.in_features}) to be a multiple of its group size "
                             f"{group_size}, itself a multiple of {INT4_RUN}")
        self.compute_dtype = weight.dtype
        codes, params = pack_int4(*quantize_int4(weight, group_size))
        self.register_buffer("codes", codes)
        self.register_buffer("params", params)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._kernel = lowbit_gemm() if weight.device.type == "cpu" else None

    @property
    def weight_bytes(self) -> int:
        return self.codes.numel() + self.params.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        if self._kernel is not None and 0 < x.shape[0] <= self._kernel.max_rows and x.dtype in (
                torch.float32, torch.bfloat16):
            return self._kernel.linear_int4(x.contiguous(), self.codes, self.params, self.out_features, self.bias)
        return self.widened(x)

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        """The product through weights widened to x's dtype, ``TILES_PER_CHUNK`` tiles at a time."""
        out = x.new_empty(x.shape[0], self.out_features)
        num_tiles = self.codes.shape[0]
        for start in range(0, num_tiles, TILES_PER_CHUNK):
            chunk = slice(start, min(start + TILES_PER_CHUNK, num_tiles))
            weight = unpack_int4(self.codes, self.params, self.out_features, x.dtype, chunk)
            rows = slice(start * TILE_ROWS, start * TILE_ROWS + weight.shape[0])
            out[:, rows] = F.linear(x, weight, None if self.bias is None else self.bias[rows])
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme=int4"
