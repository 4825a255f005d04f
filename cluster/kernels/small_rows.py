"""How many rows bfloat16 layers give ``small_gemm`` on this CPU: measured once per process.

``small_gemm`` computes each row the same way whatever the row count, so the more rows it takes,
the longer a batch-1 verification reproduces plain decoding bit for bit; past some row count the
next kernel (oneDNN's packed bfloat16 GEMM, ``widening_gemm`` where the float32 probe chose it, or
``pair_gemm`` where the pair-product probe did)
is faster. Below ``SMALL_GEMM_MAX_ROWS`` small_gemm always keeps its rows (their speed was
measured when that floor was set); above it, the probe times both kernels at each of
``CANDIDATE_ROWS`` on weights that do not fit a core's L2 cache, in turn, and small_gemm keeps
every candidate up to the first where it is slower. On a 2-core AMD EPYC (Zen 5, AVX-512-BF16, no
AMX, 46 GB/s read) all of SmolLM2-135M's linear layers took 7.8 / 8.4 / 11.3 ms at 10 / 12 / 16
rows through small_gemm against 9.3 / 9.5 / 11.2 through oneDNN, so there it keeps 12 rows or 16
depending on the run; where AMX makes oneDNN's few-row GEMM nearly free it keeps the floor.
``TANDEM_SMALL_GEMM_PROBE=0`` keeps the floor everywhere (A/B runs).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from cluster.kernels.build import pair_gemm, small_gemm, widening_gemm
from cluster.kernels.float32_gemm import best_pass_seconds, float32_gemm_min_rows
from cluster.kernels.pair_products import pair_gemm_wins

logger = logging.getLogger(__name__)

# The rows small_gemm takes without a probe (see packed_linear), and the counts probed above them.
SMALL_GEMM_MAX_ROWS = {torch.float32: 8, torch.bfloat16: 9}
CANDIDATE_ROWS = (10, 12, 16)
_PROBE_SHAPE = (1536, 576)
_PROBE_WEIGHTS = 8
_PROBE_ROUNDS = 5


@functools.lru_cache(maxsize=None)
def small_gemm_max_rows(dtype: torch.dtype) -> int:
    """The most rows a ``dtype`` layer sends to small_gemm here: the floor, raised for bfloat16
    to the largest candidate up to which small_gemm was never slower than the next kernel."""
    floor = SMALL_GEMM_MAX_ROWS[dtype]
    if dtype != torch.bfloat16 or os.environ.get("TANDEM_SMALL_GEMM_PROBE", "1") == "0" or small_gemm() is None:
        return floor
    try:
        times = _probe()
    except RuntimeError as err:  # oneDNN has no bfloat16 path on this CPU
        logger.info("small_gemm rows: not probed (%s)", err)
        return floor
    chosen = floor
    for rows in CANDIDATE_ROWS:
        if times[rows][0] > times[rows][1]:
            break
        chosen = rows
    logger.info("small_gemm rows: %d (ms small_gemm / next kernel at %s)", chosen,
                ", ".join(f"{r}: {s * 1e3:.2f} / {o * 1e3:.2f}" for r, (s, o) in times.items()))
    return chosen


def _probe() -> dict[int, tuple[float, float]]:
    """rows -> (small_gemm seconds, next kernel's seconds) for a pass over the probe's weights."""
    kernel = small_gemm()
    generator = torch.Generator().manual_seed(0)
    plain = [torch.randn(_PROBE_SHAPE, generator=generator).to(torch.bfloat16) for _ in range(_PROBE_WEIGHTS)]
    small = [kernel.pack(w) for w in plain]
    widening_from = float32_gemm_min_rows()
    wide = widening_gemm()
    if widening_from is not None:
        other = [wide.pack(w) for w in plain]
        run_other = lambda x: [wide.linear(x, w, _PROBE_SHAPE[0], None) for w in other]  # noqa: E731
    elif pair_gemm_wins():
        pairs = pair_gemm()
        other = [pairs.pack(w) for w in plain]
        run_other = lambda x: [pairs.linear(x, w, _PROBE_SHAPE[0], None) for w in other]  # noqa: E731
    else:
        other = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in plain]
        run_other = lambda x: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
                               for w in other]
    times = {}
    for rows in CANDIDATE_ROWS:
        x = torch.randn(rows, _PROBE_SHAPE[1], generator=generator).to(torch.bfloat16)
        best = best_pass_seconds([lambda: [kernel.linear(x, w, _PROBE_SHAPE[0], None) for w in small],
                                  lambda: run_other(x)], _PROBE_ROUNDS)
        times[rows] = (best[0], best[1])
    return times
