"""Whether bfloat16 linear layers of several rows run faster in float32 arithmetic on this CPU.

A CPU with AVX-512-BF16 but no AMX may multiply bfloat16 pairs slower than float32 ones: on a
2-core Intel Xeon (Emerald Rapids, AMX not exposed) the pair product issued a quarter as often as
a float32 FMA, twice the work each (86 against 176 GFLOPS a core, a register-only loop), and
oneDNN's packed bfloat16 GEMM reached 80-150 GFLOPS on SmolLM2's shapes (2 threads).
For a few rows a step is bound by reading the weights, from about ten rows by arithmetic, and
there float32 FMAs on the bfloat16 weights widened in registers
(:mod:`cluster.kernels` ``widening_gemm``) are ahead without reading a float32 copy: all of
SmolLM2-135M's linear layers in turn took 23.5 / 30.4 / 45.6 / 59.6 / 140 ms at 10 / 16 / 32 / 48
/ 128 rows against oneDNN bfloat16's 33.6 / 44.4 / 67.5 / 95.1 / 219 (and oneDNN float32 on a
float32 copy 35.2 / 43.3 / 59.0 / 78.4 / 147). Elsewhere bfloat16 computes faster: with AMX,
and on an AMD CPU with AVX-512-BF16 (whole decode steps at batch 32 1.6x float32's speed, the
README's table). So whether the widening kernel leads is measured, once per process, at 32 rows
on weights that do not fit a core's L2 cache (about 0.1 s); where it leads by 1.1x there, a
:class:`~cluster.kernels.packed_linear.PackedLinear` packs each bfloat16 weight for it too and
takes it from ``FLOAT32_FROM_ROWS`` rows on (small_gemm keeps the rows it takes).
``TANDEM_FLOAT32_GEMM=0`` keeps oneDNN's bfloat16 everywhere (A/B runs, or results that never
depend on this probe), as does ``TANDEM_CPU_KERNELS=0``.

The float32 path computes the same sums as oneDNN's bfloat16 one (a product of two bfloat16
numbers is exact in float32, and both accumulate in float32), only in another order, and
rounds the result to bfloat16.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Callable

import torch

from cluster.kernels.build import widening_gemm

logger = logging.getLogger(__name__)

# From this many rows a layer computes in float32 where the probe finds float32 ahead.
FLOAT32_FROM_ROWS = 10
# The rows probed, and the shape and number of distinct weights a pass reads (14 MB in
# bfloat16: more than a core's L2 cache, like a model's layers in a forward pass).
_PROBE_ROWS = 32
_PROBE_SHAPE = (1536, 576)
_PROBE_WEIGHTS = 8
_PROBE_ROUNDS = 6
# float32 must be this much faster at the probed rows to be used.
_MIN_SPEEDUP = 1.1


@functools.lru_cache(maxsize=None)
def float32_gemm_min_rows() -> int | None:
    """The fewest rows from which a bfloat16 linear layer is computed in float32 here, or None
    where float32 is never faster enough (or the widening kernel or oneDNN's bfloat16 path is
    missing), or where ``TANDEM_FLOAT32_GEMM=0``."""
    if os.environ.get("TANDEM_FLOAT32_GEMM", "1") == "0":
        logger.info("float32 GEMMs for bfloat16 weights: turned off by TANDEM_FLOAT32_GEMM=0")
        return None
    if widening_gemm() is None:
        logger.info("float32 GEMMs for bfloat16 weights: no widening_gemm kernel here (it needs AVX-512)")
        return None
    try:
        speedup = _probe()
    except RuntimeError as err:  # oneDNN lacks a bfloat16 path on this CPU
        logger.info("float32 GEMMs for bfloat16 weights: not probed (%s)", err)
        return None
    chosen = FLOAT32_FROM_ROWS if speedup >= _MIN_SPEEDUP else None
    logger.info("float32 GEMMs at %d rows: %.2fx bfloat16's speed; bfloat16 weights %s", _PROBE_ROWS, speedup,
                "stay bfloat16" if chosen is None else f"are computed in float32 from {chosen} rows")
    return chosen


def _probe() -> float:
    """oneDNN bfloat16 time / widening_gemm time of a pass over the probe's weights at ``_PROBE_ROWS``
    rows: the best of several passes of each, taken in turn so that a burst of load elsewhere hits both."""
    kernel = widening_gemm()
    generator = torch.Generator().manual_seed(0)
    plain = [torch.randn(_PROBE_SHAPE, generator=generator).to(torch.bfloat16) for _ in range(_PROBE_WEIGHTS)]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in plain]
    widened = [kernel.pack(w) for w in plain]
    x = torch.randn(_PROBE_ROWS, _PROBE_SHAPE[1], generator=generator).to(torch.bfloat16)
    onednn_s, widening_s = best_pass_seconds(
        [lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in onednn],
         lambda: [kernel.linear(x, w, _PROBE_SHAPE[0], None) for w in widened]], _PROBE_ROUNDS)
    return onednn_s / widening_s


def best_pass_seconds(passes: list[Callable[[], object]], rounds: int) -> list[float]:
    """Each pass's best time over ``rounds``, the passes taken in turn so that a burst of load
    elsewhere hits them all, after one untimed call each (which warms oneDNN's primitive cache)."""
    best = [float("inf")] * len(passes)
    for run in passes:
        run()
    for _ in range(rounds):
        for i, run in enumerate(passes):
            started = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - started)
    return best
