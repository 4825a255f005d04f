"""Tandem's capacity autoscaling policy: the batch size where a replica's throughput levels off,
the load each replica reports against it, and the replica count the policy asks Serve for."""

from __future__ import annotations

from types import SimpleNamespace

from cluster.routing.policy import peak_tokens_per_second, saturation_batch
from deployments.autoscaling_policy import LOAD_METRIC, CapacityPolicy

# A step takes 10 ms plus 1 ms per sequence: throughput b / (10 + b) ms levels off past ~90 sequences.
CURVE = [(b, 0.010 + 0.001 * b) for b in (1, 2, 4, 8, 16, 32, 64, 128)]


def test_the_knee_is_the_smallest_batch_near_the_peak():
    knee = saturation_batch(CURVE, 0.0, 0)
    peak = peak_tokens_per_second(CURVE, 0.0, 0)
    assert knee == 128 or knee / (0.010 + 0.001 * knee) >= 0.9 * peak
    flat = [(b, 0.010 * b) for b in (1, 2, 4, 8)]  # compute-bound from the start: one sequence is the peak
    assert saturation_batch(flat, 0.0, 0) == 1
    assert saturation_batch([], 0.5, 2) is None


def _ctx(replicas: int, loads: dict | None, requests: float = 0.0, target: int = 1):
    config = SimpleNamespace(get_target_ongoing_requests=lambda: 8.0)
    return SimpleNamespace(current_num_replicas=replicas, target_num_replicas=target, total_num_requests=requests,
                           aggregated_metrics={LOAD_METRIC: loads} if loads is not None else {}, config=config)


def test_the_policy_keeps_the_mean_load_at_its_target():
    policy = CapacityPolicy(target_load=0.8)
    assert policy(_ctx(2, {"a": 1.2, "b": 0.8}))[0] == 2 * 1.0 / 0.8  # loaded: 2.5 replicas wanted
    assert policy(_ctx(4, {"a": 0.1, "b": 0.1, "c": 0.1, "d": 0.1}))[0] == 0.5  # idle: Serve's floor and delays apply
    assert policy(_ctx(3, {"a": 1.6}))[0] == 3 * 1.6 / 0.8  # unreported replicas count as the mean
    assert policy(_ctx(2, None, requests=24))[0] == 3.0  # nothing reported yet: Serve's own rule
    assert policy(_ctx(0, None, requests=1, target=0))[0] == 1  # scaled to zero: start one for a waiting request
    assert policy(_ctx(0, None, requests=0, target=0))[0] == 0
