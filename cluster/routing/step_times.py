"""How long this replica's steps take, as the router needs it: a curve of seconds per
decoding step against batch size at the current k, and seconds per prefill token.

With a device profile (``LatencyModel``), the curve is the profile's prediction times a
*speed factor*: the running mean of measured / predicted time over recent decode
steps, so a device that is slower than profiled (a noisy neighbour, a throttled GPU,
or the ``step_time_scale`` emulation) shows up within a few steps. Without a profile,
the curve is a least-squares line ``seconds = a + c * batch_size`` through recent
decode steps (a flat line while only one batch size has been seen). Before any
decode step has been seen the curve is empty and the router falls back.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from cluster.spec.latency_model import LatencyModel

_CURVE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class StepTimeTracker:
    def __init__(self, model: LatencyModel | None = None, window: int = 256, smoothing: float = 0.1) -> None:
        self.model = model
        self.smoothing = smoothing
        self._decode_steps: deque[tuple[int, float]] = deque(maxlen=window)  # (batch size, seconds)
        self.speed_factor = 1.0
        self.prefill_seconds_per_token = 0.0
        self._seen_speed = False

    def observe(self, num_seqs: int, k: int, num_prefill_tokens: int, seconds: float) -> None:
        if num_seqs <= 0 or seconds <= 0:
            return
        if num_prefill_tokens > 0:
            per_token = seconds / num_prefill_tokens
            self.prefill_seconds_per_token = self._smooth(self.prefill_seconds_per_token, per_token,
                                                          first=self.prefill_seconds_per_token == 0.0)
            return
        self._decode_steps.append((num_seqs, seconds))
        if self.model is not None:
            predicted = self.model.step_time(num_seqs, k)
            if predicted > 0:
                self.speed_factor = self._smooth(self.speed_factor, seconds / predicted, first=not self._seen_speed)
                self._seen_speed = True

    def curve(self, k: int, max_batch_size: int) -> tuple[tuple[int, float], ...]:
        """(batch size, seconds per decoding step) for batch sizes up to ``max_batch_size``."""
        sizes = [b for b in _CURVE_BATCH_SIZES if b < max_batch_size] + [max_batch_size]
        if self.model is not None:
            return tuple((b, self.model.step_time(b, k) * self.speed_factor) for b in sizes)
        if not self._decode_steps:
            return ()
        batch = np.array([b for b, _ in self._decode_steps], dtype=np.float64)
        seconds = np.array([t for _, t in self._decode_steps], dtype=np.float64)
        if np.ptp(batch) == 0:
            intercept, slope = float(seconds.mean()), 0.0
        else:
            slope, intercept = (float(c) for c in np.polyfit(batch, seconds, 1))
            slope = max(slope, 0.0)
        floor = float(seconds.min())
        return tuple((b, max(intercept + slope * b, floor)) for b in sizes)

    def _smooth(self, current: float, sample: float, first: bool) -> float:
        return sample if first else (1 - self.smoothing) * current + self.smoothing * sample
