"""Tandem's autoscaling policy for an engine group (``autoscaling.policy: capacity``), through Ray
Serve's custom policy API.

Ray Serve's own policy keeps ``target_ongoing_requests`` requests per replica, one number for
every replica of every kind of device. This one asks each replica how loaded it is against its
own capacity (``TandemReplica.record_autoscaling_stats``): its requests (running and waiting)
over the batch size at which its predicted output tokens/s level off (90% of the peak of its
step-time curve, at its current k and acceptance: ``saturation_batch``), so a faster kind of GPU,
or a replica whose drafts are accepted more, takes more before the group grows. The group is
sized to keep the mean load at ``target_load``; Serve applies the bounds and the up- and
downscale delays as for its own policy. Replicas that have not reported count as the mean of
those that have; with none reported yet, Serve's own rule decides.
"""

from __future__ import annotations

LOAD_METRIC = "tandem_load"


class CapacityPolicy:
    def __init__(self, target_load: float = 0.8) -> None:
        self.target_load = target_load

    def __call__(self, ctx) -> tuple[float, dict]:
        """The desired number of replicas (before Serve's bounds and delays) and the policy's state."""
        replicas = ctx.current_num_replicas
        if replicas == 0:  # scaled to zero: one replica as soon as a request waits
            return (1 if ctx.total_num_requests > 0 else ctx.target_num_replicas), {}
        loads = list(((ctx.aggregated_metrics or {}).get(LOAD_METRIC) or {}).values())
        if not loads:
            return ctx.total_num_requests / ctx.config.get_target_ongoing_requests(), {}
        total = sum(loads) / len(loads) * replicas
        return total / self.target_load, {}
