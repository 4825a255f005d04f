"""Pass times read from a profile's measured grid, for any batch size and token count.

``tandem profile`` times the verifying pass at batch sizes 1, 2, 4, ... and 1..K + 1 tokens
per request, and one draft pass per batch size. On a CPU these times are not linear in the
tokens (an extra token per request is nearly free at batch 1 and costs ~0.5 ms at batch 32),
so a controller that wants the step time of a length ``k`` at the live batch size reads it
from the grid: linear between the measured token counts (fractional counts come from
proposers that draft fewer tokens than asked), and linear in the batch size between the
measured sizes (beyond the largest, the last two sizes' line carries on; never below the
largest size's time).
"""

from __future__ import annotations

import bisect

import numpy as np


class PassGrid:
    def __init__(self, target_grid: list[tuple[int, int, float]], draft_grid: list[tuple[int, float]],
                 max_tokens: int) -> None:
        """``target_grid``: (batch size, tokens per request, seconds per verifying pass); every batch
        size must be measured from 1 up to ``max_tokens`` tokens per request. ``draft_grid``:
        (batch size, seconds per draft pass), may be empty (no draft model: drafting is free)."""
        by_size: dict[int, list[tuple[float, float]]] = {}
        for b, n, t in target_grid:
            by_size.setdefault(int(b), []).append((float(n), float(t)))
        if not by_size:
            raise ValueError("a pass grid needs measured passes")
        tokens = np.arange(1, max_tokens + 1, dtype=np.float64)
        self.sizes = sorted(by_size)
        self._rows = []  # per measured size: seconds at 1..max_tokens tokens per request
        for b in self.sizes:
            passes = sorted(by_size[b])
            if passes[0][0] > 1 or passes[-1][0] < max_tokens:
                raise ValueError(f"batch size {b} is measured at {passes[0][0]:g}..{passes[-1][0]:g} tokens per "
                                 f"request, the grid needs 1..{max_tokens}")
            self._rows.append(np.interp(tokens, [n for n, _ in passes], [t for _, t in passes]).tolist())
        drafts = sorted((int(b), float(t)) for b, t in draft_grid)
        self._draft_sizes = [b for b, _ in drafts]
        self._draft_times = [t for _, t in drafts]
        self._cache: dict[int, list[float]] = {}

    def verify_row(self, batch_size: int) -> list[float]:
        """Seconds of the verifying pass at 1..max_tokens tokens per request for ``batch_size``."""
        row = self._cache.get(batch_size)
        if row is None:
            row = self._cache[batch_size] = [float(t) for t in self._between_sizes(batch_size)]
        return row

    def verify_time(self, batch_size: int, tokens_per_request: float) -> float:
        return read_row(self.verify_row(batch_size), tokens_per_request)

    def draft_time(self, batch_size: int) -> float:
        if not self._draft_sizes:
            return 0.0
        return _line(self._draft_sizes, self._draft_times, batch_size)

    def _between_sizes(self, batch_size: int) -> list[float]:
        sizes, rows = self.sizes, self._rows
        if len(sizes) == 1:
            return rows[0]
        i = min(max(bisect.bisect_left(sizes, batch_size), 1), len(sizes) - 1)
        lo, hi = sizes[i - 1], sizes[i]
        w = (batch_size - lo) / (hi - lo)
        row = [a + w * (b - a) for a, b in zip(rows[i - 1], rows[i])]
        if batch_size > sizes[-1]:
            row = [max(t, last) for t, last in zip(row, rows[-1])]
        if batch_size < sizes[0]:
            row = [max(t, 0.0) for t in row]
        return row


def read_row(row: list[float], tokens_per_request: float) -> float:
    """``row[n - 1]`` is the time at n tokens per request: linear between them (and past the last two)."""
    if len(row) == 1:
        return row[0]
    x = tokens_per_request - 1.0
    i = min(max(int(x), 0), len(row) - 2)
    return row[i] + (x - i) * (row[i + 1] - row[i])


def _line(xs: list[int], ys: list[float], x: float) -> float:
    """Linear through the points, carried on past either end by the nearest segment (never below 0)."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return max(ys[i - 1] + w * (ys[i] - ys[i - 1]), 0.0)
