"""Whether bfloat16 linear layers run faster on the CPU's bfloat16 pair product here.

Above the rows small_gemm takes, a step is bound by arithmetic. oneDNN's packed bfloat16 GEMM
reaches the CPU's peak only for hundreds of rows: on a 2-core AMD EPYC (Zen 4, AVX-512-BF16, no
AMX) all of SmolLM2-135M's linear layers took 14.7 / 17.7 / 27.6 / 47.4 / 87.3 / 170 ms at 10 /
16 / 32 / 64 / 128 / 256 rows through it, and 8.9 / 12.6 / 22.2 / 41.4 / 81.5 / 163 through
:mod:`cluster.kernels` ``pair_gemm`` (its own panels, 24 float32 sums in registers fed by the pair
product, 1.64 / 1.40 / 1.24 / 1.15 / 1.07 / 1.04x). Where the pair product is slow (a Xeon without
AMX, where float32 arithmetic already beats oneDNN's bfloat16: :mod:`cluster.kernels.float32_gemm`)
or AMX makes oneDNN's GEMM far faster, oneDNN stays. So it is measured once per process: the pair
kernel must lead by 1.05x at 32 rows and be no slower at 256 (about 0.2 s on weights that do not
fit a core's L2 cache); then a :class:`~cluster.kernels.packed_linear.PackedLinear` packs each
bfloat16 weight for it instead of for oneDNN and gives it every row small_gemm does not take.

On that Zen 4 it also read the weights faster than small_gemm at decode rows (10.8 / 10.9 / 15.3
ms small_gemm against 9.1 / 9.0 / 10.1 at 1 / 4 / 8 rows), and it computes a row alike whatever
rows share the call, as small_gemm does (a batch-1 verification still reproduces plain decoding
bit for bit). So a second probe times both at 1 and 8 rows on weights past a last-level cache;
where the pair kernel is no slower at either, it takes every row and the layer keeps no small_gemm
copy (one packed copy instead of two). ``TANDEM_PAIR_GEMM=0`` keeps oneDNN and small_gemm (A/B
runs), as does ``TANDEM_CPU_KERNELS=0``.

The pair kernel computes the same products as oneDNN's bfloat16 GEMM (exact in float32) and sums
them in float32 in another order; each output is rounded to bfloat16 once.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from cluster.kernels.build import pair_gemm, small_gemm
from cluster.kernels.float32_gemm import best_pass_seconds, float32_gemm_min_rows

logger = logging.getLogger(__name__)

# The rows probed against oneDNN: where the pair kernel must lead, and where it must not fall behind.
_BATCH_ROWS = 32  # a big decode batch
_MANY_ROWS = 256
_MIN_SPEEDUP = 1.05  # at _BATCH_ROWS
_MIN_SPEED_MANY = 0.97  # at _MANY_ROWS: no slower, within a probe's noise
_MIN_SPEED_FEW = 1.0  # against small_gemm at 1 and 8 rows
# The shape and number of distinct weights a pass reads (14 MB: more than a core's L2 cache).
_PROBE_SHAPE = (1536, 576)
_PROBE_WEIGHTS = 8
_FEW_PROBE_WEIGHTS = 32  # 57 MB: past a last-level cache, as a decode step's weights are
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
    logger.info("pair_gemm at %d / %d rows: %.2fx / %.2fx oneDNN's bfloat16 speed; %s", _BATCH_ROWS, _MANY_ROWS, few,
                many, "bfloat16 layers use it above small_gemm's rows" if chosen else "oneDNN stays")
    return chosen


@functools.lru_cache(maxsize=None)
def pair_gemm_takes_few_rows() -> bool:
    """Whether ``pair_gemm`` also takes the decode rows small_gemm would (it computes each row alike
    whatever the rows beside it, so a batch-1 verification still reproduces plain decoding): where
    :func:`pair_gemm_wins` and it is no slower than small_gemm at 1 and 8 rows (or small_gemm is missing)."""
    if not pair_gemm_wins():
        return False
    if small_gemm() is None:
        return True
    one, eight = _probe_few()
    chosen = one >= _MIN_SPEED_FEW and eight >= _MIN_SPEED_FEW
    logger.info("pair_gemm at 1 / 8 rows: %.2fx / %.2fx small_gemm's speed; %s", one, eight,
                "it takes every row" if chosen else "small_gemm keeps its rows")
    return chosen


def _probe_few() -> tuple[float, float]:
    """small_gemm time / pair_gemm time of a pass over weights larger than a CPU's last-level cache
    (a decode step reads its weights from memory) at 1 and 8 rows."""
    few_rows = small_gemm()
    kernel = pair_gemm()
    generator = torch.Generator().manual_seed(0)
    plain = [torch.randn(_PROBE_SHAPE, generator=generator).to(torch.bfloat16) for _ in range(_FEW_PROBE_WEIGHTS)]
    small = [few_rows.pack(w) for w in plain]
    pairs = [kernel.pack(w) for w in plain]
    ratios = []
    for rows in (1, 8):
        x = torch.randn(rows, _PROBE_SHAPE[1], generator=generator).to(torch.bfloat16)
        small_s, pair_s = best_pass_seconds(
            [lambda: [few_rows.linear(x, w, _PROBE_SHAPE[0], None) for w in small],
             lambda: [kernel.linear(x, w, _PROBE_SHAPE[0], None) for w in pairs]], _PROBE_ROUNDS)
        ratios.append(small_s / pair_s)
    return ratios[0], ratios[1]


def _probe() -> tuple[float, float]:
    """oneDNN time / pair_gemm time of a pass over the probe's weights at ``_BATCH_ROWS`` and ``_MANY_ROWS``."""
    kernel = pair_gemm()
    generator = torch.Generator().manual_seed(0)
    plain = [torch.randn(_PROBE_SHAPE, generator=generator).to(torch.bfloat16) for _ in range(_PROBE_WEIGHTS)]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in plain]
    pairs = [kernel.pack(w) for w in plain]
    ratios = []
    for rows in (_BATCH_ROWS, _MANY_ROWS):
        x = torch.randn(rows, _PROBE_SHAPE[1], generator=generator).to(torch.bfloat16)
        onednn_s, pair_s = best_pass_seconds(
            [lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in onednn],
             lambda: [kernel.linear(x, w, _PROBE_SHAPE[0], None) for w in pairs]], _PROBE_ROUNDS)
        ratios.append(onednn_s / pair_s)
    return ratios[0], ratios[1]
