"""Ray Serve's request-based autoscaling, for one replica group.

Every ``period_s`` the autoscaler looks at the group's ongoing requests (running and
queued at its replicas) and wants ``ceil(ongoing / target_ongoing_requests)`` replicas,
clamped to ``[min_replicas, max_replicas]``. As in Ray Serve, a change is applied only
after the wish has pointed the same way for ``upscale_delay_s`` (up) or
``downscale_delay_s`` (down) of consecutive decisions; a decision the other way, or
none, resets the count. The target counts replicas still starting, so a slow start
does not trigger a second scale-up for the same load.
"""

from __future__ import annotations

import math

from cluster.config_serve import AutoscalingConfig


class GroupAutoscaler:
    def __init__(self, config: AutoscalingConfig, period_s: float) -> None:
        self.config = config
        self.period_s = period_s
        self._decisions = 0  # > 0: consecutive wishes to scale up; < 0: down

    def initial_replicas(self) -> int:
        c = self.config
        return c.initial_replicas if c.initial_replicas is not None else c.min_replicas

    def desired(self, ongoing: int) -> int:
        c = self.config
        return min(max(math.ceil(ongoing / c.target_ongoing_requests), c.min_replicas), c.max_replicas)

    def decide(self, ongoing: int, current: int) -> int:
        """The number of replicas the group should have after this decision."""
        want = self.desired(ongoing)
        if want > current:
            self._decisions = max(self._decisions, 0) + 1
            if self._decisions * self.period_s > self.config.upscale_delay_s:
                self._decisions = 0
                return want
        elif want < current:
            self._decisions = min(self._decisions, 0) - 1
            if -self._decisions * self.period_s > self.config.downscale_delay_s:
                self._decisions = 0
                return want
        else:
            self._decisions = 0
        return current
