"""Whether bfloat16 linear layers of many rows run faster on the CPU's bfloat16 pair product here.

Above the rows small_gemm takes, a step is bound by arithmetic. oneDNN's packed bfloat16 GEMM
reaches the CPU's peak only for hundreds of rows: on a 2-core AMD EPYC (Zen 4, AVX-512-BF16, no
AMX) all of SmolLM2-135M's linear layers took 14.7 / 17.7 / 27.6 / 47.4 / 87.3 / 170 ms at 10 /
16 / 32 / 64 / 128 / 256 rows through it, and 8.9 / 12.6 / 22.2 / 41.4 / 81.5 / 163 through
:mod:`cluster.kernels` ``pair_gemm`` (its own panels, 24 float32 sums in registers fed by the pair
product, 1.64 / 1.40 / 1.24 / 1.15 / 1.07 / 1.04x). Where the pair product is slow (a Xeon without
AMX, where float32 arithmetic already beats oneDNN's bfloat16: :mod:`cluster.kernels.float32_gemm`)
or AMX makes oneDNN's GEMM far faster, oneDNN stays. So it is measured once per process: the pair
kernel must lead by 1.1x at 32 rows and be no slower at 256 (about 0.2 s on weights that do not fit
a core's L2 cache); then a :class:`~cluster.kernels.packed_linear.PackedLinear` packs each bfloat16
weight for it instead of for oneDNN (the same memory) and gives it every row small_gemm does not take.
``TANDEM_PAIR_GEMM=0`` keeps oneDNN (A/B runs), as does ``TANDEM_CPU_KERNELS=0``.

The pair kernel computes the same products as oneDNN's bfloat16 GEMM (exact in float32) and sums
them in float32 in another order; each output is rounded to bfloat16 once.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from cluster.kernels.build import pair_gemm
from cluster.kernels.float32_gemm import best_pass_seconds, float32_gemm_min_rows

logger = logging.getLogger(__name__)

# The rows probed: where the pair kernel must lead, and where it must not fall behind.
_FEW_ROWS = 32
_MANY_ROWS = 256
_MIN_SPEEDUP = 1.1  # at _FEW_ROWS
_MIN_SPEED_MANY = 0.97  # at _MANY_ROWS: no slower, within a probe's noise
# The shape and number of distinct weights a pass reads (14 MB: more than a core's L2 cache).
_PROBE_SHAPE = (1536, 576)
_PROBE_WEIGHTS = 8
_PROBE_ROUNDS = 5


@functools.lru_cache(maxsize=None)
def pair_gemm_wins() -> bool:
    """Whether bfloat16 layers here compute the rows small_gemm leaves through ``pair_gemm``
    instead of oneDNN: False where ``TANDEM_PAIR_GEMM=0``, the kernel is missing (no AVX-512-BF16),
    float32 arithmetic was chosen (the pair product is slow here) or the probe finds it behind."""
    if os.environ.get("TANDEM_PAIR_GEMM", "1") == "0":
        logger.info("pair_gemm for bfloat16 weights: turned off by TANDEM_PAIR_GEMM=0")
        return False
    if pair_gemm() is None:
        logger.info("pair_gemm for bfloat16 weights: not built here (it needs AVX-512-BF16)")
        return False
    if float32_gemm_min_rows() is not None:
        logger.info("pair_gemm for bfloat16 weights: not used, float32 arithmetic is faster here")
        return False
    try:
        few, many = _probe()
    except RuntimeError as err:  # oneDNN lacks a bfloat16 path on this CPU
        logger.info("pair_gemm for bfloat16 weights: not probed (%s)", err)
        return False
    chosen = few >= _MIN_SPEEDUP and many >= _MIN_SPEED_MANY
    logger.info("pair_gemm at %d / %d rows: %.2fx / %.2fx oneDNN's bfloat16 speed; %s", _FEW_ROWS, _MANY_ROWS, few,
                many, "bfloat16 layers use it above small_gemm's rows" if chosen else "oneDNN stays")
    return chosen


def _probe() -> tuple[float, float]:
    """oneDNN time / pair_gemm time of a pass over the probe's weights at ``_FEW_ROWS`` and ``_MANY_ROWS``."""
    kernel = pair_gemm()
    generator = torch.Generator().manual_seed(0)
    plain = [torch.randn(_PROBE_SHAPE, generator=generator).to(torch.bfloat16) for _ in range(_PROBE_WEIGHTS)]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in plain]
    pairs = [kernel.pack(w) for w in plain]
    ratios = []
    for rows in (_FEW_ROWS, _MANY_ROWS):
        x = torch.randn(rows, _PROBE_SHAPE[1], generator=generator).to(torch.bfloat16)
        onednn_s, pair_s = best_pass_seconds(
            [lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in onednn],
             lambda: [kernel.linear(x, w, _PROBE_SHAPE[0], None) for w in pairs]], _PROBE_ROUNDS)
        ratios.append(onednn_s / pair_s)
    return ratios[0], ratios[1]
