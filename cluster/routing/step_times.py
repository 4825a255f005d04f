"""How long this replica's steps take, as the router needs it: a curve of seconds per
decoding step against batch size at the current k, and seconds per prefill token.

With a device profile (``LatencyModel``, and its n-gram coverage where it has one: a
verifying pass carries the draft tokens lookup proposes, not k), the curve is the
profile's prediction times a *speed factor*: the running mean of measured / predicted
time over recent decode steps, so a device that is slower than profiled (a noisy
neighbour, a throttled GPU, or the ``step_time_scale`` emulation) shows up within a few
steps. Without a profile, the curve is a least-squares line ``seconds = a + c *
batch_size`` through recent decode steps (a flat line while only one batch size has been
seen). Before any decode step has been seen the curve is empty and the router falls back.

Seconds per prefill token are *marginal*: a step that computes prompt tokens (most
steps of a busy replica mix prefill chunks into the decoding batch) counts only the
time beyond what the curve predicts for decoding its ``num_seqs`` sequences, divided by
its prompt tokens; before any curve exists, the whole step. So the figure is the time
prefill adds to the replica's steps, which is what the requests queued and running
there wait for (the whole mixed step over its prompt tokens would count the decoding
of the whole batch as prefill, several times too much on a big batch).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from cluster.spec_decode.latency_model import LatencyModel

_CURVE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class StepTimeTracker:
    def __init__(self, model: LatencyModel | None = None, coverage: list[float] | None = None, window: int = 256,
                 smoothing: float = 0.1) -> None:
        self.model = model
        self.coverage = coverage
        self.smoothing = smoothing
        self._decode_steps: deque[tuple[int, float]] = deque(maxlen=window)  # (batch size, seconds)
        self.speed_factor = 1.0
        self.prefill_seconds_per_token = 0.0
        self._seen_speed = False
        self._seen_prefill = False
        self._line: tuple[float, float, float] | None = None  # (intercept, slope, floor) of the fit

    def observe(self, num_seqs: int, k: int, num_prefill_tokens: int, seconds: float) -> None:
        if num_seqs <= 0 or seconds <= 0:
            return
        if num_prefill_tokens > 0:
            decoding = self._decode_seconds(num_seqs, k)
            spent = seconds if decoding is None else max(seconds - decoding, 0.0)
            self.prefill_seconds_per_token = self._smooth(self.prefill_seconds_per_token, spent / num_prefill_tokens,
                                                          first=not self._seen_prefill)
            self._seen_prefill = True
            return
        self._decode_steps.append((num_seqs, seconds))
        self._line = None
        if self.model is not None:
            predicted = self.model.step_time(num_seqs, k, self.coverage)
            if predicted > 0:
                self.speed_factor = self._smooth(self.speed_factor, seconds / predicted, first=not self._seen_speed)
                self._seen_speed = True

    def curve(self, k: int, max_batch_size: int) -> tuple[tuple[int, float], ...]:
        """(batch size, seconds per decoding step) for batch sizes up to ``max_batch_size``."""
        sizes = [b for b in _CURVE_BATCH_SIZES if b < max_batch_size] + [max_batch_size]
        if self.model is None and not self._decode_steps:
            return ()
        return tuple((b, self._decode_seconds(b, k)) for b in sizes)

    def _decode_seconds(self, batch_size: int, k: int) -> float | None:
        """Predicted seconds of a decoding step of ``batch_size`` at ``k``; None before
        there is a profile or a decode step to predict from."""
        if self.model is not None:
            return self.model.step_time(batch_size, k, self.coverage) * self.speed_factor
        if not self._decode_steps:
            return None
        if self._line is None:
            self._line = self._fit_line()
        intercept, slope, floor = self._line
        return max(intercept + slope * batch_size, floor)

    def _fit_line(self) -> tuple[float, float, float]:
        batch = np.array([b for b, _ in self._decode_steps], dtype=np.float64)
        seconds = np.array([t for _, t in self._decode_steps], dtype=np.float64)
        if np.ptp(batch) == 0:
            intercept, slope = float(seconds.mean()), 0.0
        else:
            slope, intercept = (float(c) for c in np.polyfit(batch, seconds, 1))
            slope = max(slope, 0.0)
        return intercept, slope, float(seconds.min())

    def _smooth(self, current: float, sample: float, first: bool) -> float:
        return sample if first else (1 - self.smoothing) * current + self.smoothing * sample
