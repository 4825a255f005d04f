"""Whether bfloat16 linear layers of many rows run faster as float32 GEMMs on this CPU.

A CPU with AVX-512-BF16 but no AMX multiplies bfloat16 pairs no faster than float32 ones:
on an Intel Xeon (Emerald Rapids, AMX not exposed) oneDNN's packed bfloat16 GEMM reached
140-165 GFLOPS where its float32 GEMM reached 235-265 (2 threads, SmolLM2's shapes). For
few rows a step is bound by reading the weights, and bfloat16 weights are half as many
bytes, so bfloat16 stays ahead there; from a few dozen rows (prefill chunks, big decode
batches) the step is bound by arithmetic and float32 is ahead. All of SmolLM2-135M's linear
layers in turn, bfloat16 over float32 time: 0.81 / 1.00 / 1.05 / 1.16 / 1.31 at 10 / 24 /
32 / 48 / 128 rows. Elsewhere bfloat16 computes faster: with AMX, and on an AMD CPU with
AVX-512-BF16 (whole decode steps at batch 32 1.6x float32's speed, the README's table).
So whether float32 leads at all is measured, once per process, at 128 rows on weights that
do not fit a core's L2 cache (0.3 s); where it leads by 1.1x there, a
:class:`~cluster.kernels.packed_linear.PackedLinear` keeps a float32 copy of each bfloat16
weight and takes it from ``FLOAT32_FROM_ROWS`` rows on. That row count is the Xeon's
crossover above, not probed: at 48 rows the probe's ratio moved between 0.89 and 1.24 from
one start to the next (a server starts beside Ray's processes), at 128 between 1.30 and 1.52.
``TANDEM_FLOAT32_GEMM=0`` keeps bfloat16 everywhere (A/B runs, or results that never depend
on this probe).

The float32 path computes the same sums as oneDNN's bfloat16 one (a product of two
bfloat16 numbers is exact in float32, and both accumulate in float32), only in another
order, and rounds the result to bfloat16.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

# From this many rows a layer computes in float32 where the probe finds float32 ahead.
FLOAT32_FROM_ROWS = 48
# The rows probed, and the shape and number of distinct weights a pass reads (14 MB in
# bfloat16: more than a core's L2 cache, like a model's layers in a forward pass).
_PROBE_ROWS = 128
_PROBE_SHAPE = (1536, 576)
_PROBE_WEIGHTS = 8
_PROBE_ROUNDS = 6
# float32 must be this much faster at the probed rows to be used.
_MIN_SPEEDUP = 1.1


@functools.lru_cache(maxsize=None)
def float32_gemm_min_rows() -> int | None:
    """The fewest rows from which a bfloat16 linear layer is computed in float32 here, or None
    where float32 is never faster enough (or oneDNN cannot pack both dtypes), or where
    ``TANDEM_FLOAT32_GEMM=0``."""
    if os.environ.get("TANDEM_FLOAT32_GEMM", "1") == "0":
        logger.info("float32 GEMMs for bfloat16 weights: turned off by TANDEM_FLOAT32_GEMM=0")
        return None
    try:
        speedup = _probe()
    except RuntimeError as err:  # oneDNN lacks a path for one of the dtypes on this CPU
        logger.info("float32 GEMMs for bfloat16 weights: not probed (%s)", err)
        return None
    chosen = FLOAT32_FROM_ROWS if speedup >= _MIN_SPEEDUP else None
    logger.info("float32 GEMMs at %d rows: %.2fx bfloat16's speed; bfloat16 weights %s", _PROBE_ROWS, speedup,
                "stay bfloat16" if chosen is None else f"are computed in float32 from {chosen} rows")
    return chosen


def _probe() -> float:
    """bfloat16 time / float32 time of a pass over the probe's weights at ``_PROBE_ROWS`` rows:
    the best of several passes of each, taken in turn so that a burst of load elsewhere hits both."""
    generator = torch.Generator().manual_seed(0)
    plain = [torch.randn(_PROBE_SHAPE, generator=generator) for _ in range(_PROBE_WEIGHTS)]
    packed = {dtype: [torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), 32) for w in plain]
              for dtype in (torch.bfloat16, torch.float32)}
    x = torch.randn(_PROBE_ROWS, _PROBE_SHAPE[1], generator=generator).to(torch.bfloat16)
    best = dict.fromkeys(packed, float("inf"))
    for dtype, weights in packed.items():  # warms oneDNN's primitive cache
        _pass(x, weights, dtype)
    for _ in range(_PROBE_ROUNDS):
        for dtype, weights in packed.items():
            best[dtype] = min(best[dtype], _pass(x, weights, dtype))
    return best[torch.bfloat16] / best[torch.float32]


def _pass(x: torch.Tensor, weights: list[torch.Tensor], dtype: torch.dtype) -> float:
    started = time.perf_counter()
    for weight in weights:  # converted as PackedLinear converts: in, compute, back
        torch.ops.mkldnn._linear_pointwise(x.to(dtype), weight, None, "none", [], "").to(torch.bfloat16)
    return time.perf_counter() - started
