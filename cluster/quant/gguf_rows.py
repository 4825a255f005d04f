"""How many rows (up to the kernel's 64) the GGUF blocks take in a loaded model: measured on its own layers.

Up to ``GGUF_MIN_ROWS`` rows a :class:`~cluster.quant.gguf_linear.GGUFLinear` always computes from its
blocks: every row is computed alike whatever the row count, so up to there a batch-1 verification of
``GGUF_MIN_ROWS - 1`` drafted tokens (the shipped config's k = 8) reproduces plain decoding bit for bit.
Above it the probe times the blocks against the layers' widened weights (``dense``, as packed for this
CPU) at each of ``CANDIDATE_ROWS``, over the model's gate/up projections in turn (real sizes, streamed
from memory as a forward pass streams them), and the blocks keep every candidate up to the first where
they are slower. ``TANDEM_GGUF_ROWS=N`` fixes the count instead (A/B runs; 0: never the blocks).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from cluster.kernels.float32_gemm import best_pass_seconds
from cluster.quant.gguf_linear import GGUFLinear

logger = logging.getLogger(__name__)

GGUF_MIN_ROWS = 9
CANDIDATE_ROWS = (10, 12, 16, 24, 32, 48, 64)
_PROBE_ROUNDS = 3
_PROBE_LAYER = "gate_up_proj"


def choose_gguf_rows(model: nn.Module, dtype: torch.dtype) -> int:
    """Set ``max_rows`` of every GGUFLinear of ``model`` (after ``pack_linears``) and return it."""
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    kernel_rows = min((m.max_rows for m in layers), default=0)
    if not layers or kernel_rows == 0:
        return 0
    fixed = os.environ.get("TANDEM_GGUF_ROWS")
    if fixed is not None:
        chosen = max(0, min(int(fixed), kernel_rows))
    else:
        probed = [m for name, m in model.named_modules() if isinstance(m, GGUFLinear) and name.endswith(_PROBE_LAYER)]
        chosen = _probe(probed or layers[:8], dtype, min(GGUF_MIN_ROWS, kernel_rows), kernel_rows)
    for layer in layers:
        layer.max_rows = chosen
    return chosen


def _probe(layers: list[GGUFLinear], dtype: torch.dtype, floor: int, ceiling: int) -> int:
    generator = torch.Generator().manual_seed(0)
    chosen, times = floor, {}
    with torch.inference_mode():
        for rows in (r for r in CANDIDATE_ROWS if floor < r <= ceiling):
            x = torch.randn(rows, layers[0].in_features, generator=generator).to(dtype)
            blocks, dense = best_pass_seconds([lambda: [m(x) for m in layers],
                                               lambda: [m.dense(x) for m in layers]], _PROBE_ROUNDS)
            times[rows] = (blocks, dense)
            if blocks > dense:
                break
            chosen = rows
    logger.info("GGUF blocks take up to %d rows (ms blocks / widened weights over %d layers at %s)", chosen,
                len(layers), ", ".join(f"{r}: {b * 1e3:.2f} / {d * 1e3:.2f}" for r, (b, d) in times.items()) or "-")
    return chosen
