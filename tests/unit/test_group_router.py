"""Choosing a replica group at the ingress (GroupRouter) and the step-time curves that
replicas publish for it (StepTimeTracker).

GroupRouter: a lone group is always chosen; with fresh stats the tandem policy sends
most requests to the faster group while balancing by its own in-flight counts; without
usable stats (none, or stale) it falls back to power of two choices and counts it; the
pow2 policy ignores the stats. StepTimeTracker: the speed factor against a profile, and
the least-squares line without one, on synthetic step times.
"""

from __future__ import annotations

import random

import pytest

from cluster.routing import group_router
from cluster.routing.group_router import GroupRouter
from cluster.routing.stats import ReplicaStats, RoutingRequest
from cluster.routing.step_times import StepTimeTracker
from cluster.spec_decode.latency_model import LatencyModel

NOW = 1000.0
MAX_NUM_SEQS = 64
# Decoding at k = 0 takes 10 ms + 2 ms per sequence in the batch.
PROFILE = LatencyModel(target_coef=[0.010, 0.002, 0.0], draft_coef=[0.0, 0.0])
REQUEST = RoutingRequest(num_prompt_tokens=32, expected_output_tokens=64)


def tracker_at_speed(factor: float) -> StepTimeTracker:
    """A tracker with PROFILE that has seen decode steps ``factor`` times as slow as profiled."""
    tracker = StepTimeTracker(PROFILE)
    for batch in (1, 4, 16):
        tracker.observe(batch, 0, 0, factor * PROFILE.step_time(batch, 0))
    return tracker


def replica_stats(replica_id: str, group: str, speed: float = 1.0, timestamp: float = NOW) -> ReplicaStats:
    tracker = tracker_at_speed(speed)
    return ReplicaStats(
        replica_id=replica_id, group=group, device_kind=group.upper(), timestamp=timestamp,
        num_running=0, num_waiting=0, max_num_seqs=MAX_NUM_SEQS, kv_cache_usage=0.0, current_k=0,
        acceptance=0.0, step_time_curve=tracker.curve(0, MAX_NUM_SEQS), speed_factor=tracker.speed_factor,
    )


def route(router: GroupRouter, n: int, groups=("fast", "slow"), finish_each: bool = False) -> list[str]:
    """Choose a group for ``n`` requests; with ``finish_each`` each finishes before the next."""
    chosen = []
    for _ in range(n):
        group = router.choose({g: REQUEST for g in groups}, NOW)
        chosen.append(group)
        if finish_each:
            router.on_finish(group)
    return chosen


def two_groups(policy: str = "tandem", stats=True, seed: int = 0) -> GroupRouter:
    router = GroupRouter({"fast": 1, "slow": 1}, policy, staleness_seconds=5.0, seed=seed)
    if stats:
        router.observe(replica_stats("fast-1", "fast", speed=1.0))
        router.observe(replica_stats("slow-1", "slow", speed=3.0))
    return router


# ---- GroupRouter -------------------------------------------------------------------
def test_a_single_group_is_always_chosen():
    router = GroupRouter({"only": 2}, "tandem", seed=0)
    assert route(router, 20, groups=("only",)) == ["only"] * 20
    assert router.fallbacks == 0 and router.inflight["only"] == 20
    # Also when the request can go to only one of several groups.
    router = two_groups()
    assert route(router, 10, groups=("slow",)) == ["slow"] * 10


def test_tandem_sends_the_larger_share_to_the_faster_group_and_tracks_inflight():
    router = two_groups()
    chosen = route(router, 60)
    fast, slow = chosen.count("fast"), chosen.count("slow")
    # Predicted step time grows with the in-flight load, so the slow group gets some
    # once the fast one is loaded: fast is picked while 12 + 2 L_f < 3 * (12 + 2 L_s) ms.
    assert fast >= 2 * slow and slow > 0
    assert router.fallbacks == 0
    assert dict(router.inflight) == {"fast": fast, "slow": slow}
    for group in chosen:
        router.on_finish(group)
    assert router.inflight["fast"] == 0 and router.inflight["slow"] == 0
    router.on_finish("fast")  # an extra finish never makes a count negative
    assert router.inflight["fast"] == 0


def test_tandem_with_idle_replicas_always_picks_the_faster_group():
    router = two_groups()
    assert set(route(router, 30, finish_each=True)) == {"fast"}


def test_without_stats_it_falls_back_and_spreads_over_both_groups():
    router = two_groups(stats=False)
    chosen = route(router, 40)
    assert router.fallbacks == 40
    # Power of two choices over one placeholder per group picks the less loaded one.
    assert abs(chosen.count("fast") - chosen.count("slow")) <= 1


def test_stale_stats_fall_back():
    router = GroupRouter({"fast": 1, "slow": 1}, "tandem", staleness_seconds=5.0, seed=0)
    router.observe(replica_stats("fast-1", "fast", speed=1.0, timestamp=NOW - 6.0))
    router.observe(replica_stats("slow-1", "slow", speed=3.0, timestamp=NOW - 6.0))
    chosen = route(router, 40)
    assert router.fallbacks == 40
    assert abs(chosen.count("fast") - chosen.count("slow")) <= 1
    # One group stale is enough to fall back: the costs are not comparable.
    router = GroupRouter({"fast": 1, "slow": 1}, "tandem", staleness_seconds=5.0, seed=0)
    router.observe(replica_stats("fast-1", "fast", speed=1.0))
    router.observe(replica_stats("slow-1", "slow", speed=3.0, timestamp=NOW - 6.0))
    route(router, 10)
    assert router.fallbacks == 10


def test_newer_stats_are_not_replaced_by_older_ones():
    router = two_groups()
    router.observe(replica_stats("slow-1", "slow", speed=1.0, timestamp=NOW - 1.0))
    assert router.snapshot()["replicas"]["slow-1"]["speed_factor"] == pytest.approx(3.0)
    newer = replica_stats("slow-1", "slow", speed=1.0, timestamp=NOW + 1.0)
    router.observe(newer)
    shown = router.snapshot()["replicas"]["slow-1"]
    assert shown["speed_factor"] == pytest.approx(1.0)
    # /debug/router shows the curve the cost model reads
    assert shown["step_time_curve"] == [[b, t] for b, t in newer.step_time_curve] and len(newer.step_time_curve) > 1


def test_pow2_never_ranks_by_stats(monkeypatch):
    def no_ranking(*args, **kwargs):
        raise AssertionError("pow2 must not rank by predicted completion time")

    monkeypatch.setattr(group_router, "rank_replicas", no_ranking)
    router = two_groups("pow2")
    chosen = route(router, 200, finish_each=True)
    # Equal loads: the draw order decides, so the 3x slower group gets about half.
    assert 60 <= chosen.count("slow") <= 140
    assert router.fallbacks == 0
    # With load building up it balances the counts, whatever the speeds.
    router = two_groups("pow2")
    chosen = route(router, 40)
    assert abs(chosen.count("fast") - chosen.count("slow")) <= 1


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="'random'"):
        GroupRouter({"a": 1}, "random")
    with pytest.raises(ValueError, match="at least one replica group"):
        GroupRouter({})


def test_snapshot_reports_decisions_per_group():
    router = two_groups()
    chosen = route(router, 12)
    router.on_finish(chosen[0])
    snap = router.snapshot()
    assert snap["policy"] == "tandem"
    assert snap["decisions"] == {g: chosen.count(g) for g in set(chosen)}
    assert sum(snap["inflight"].values()) == 11
    assert snap["fallbacks"] == 0
    assert snap["replicas"]["slow-1"]["group"] == "slow"
    assert snap["replicas"]["fast-1"]["device_kind"] == "FAST"


# ---- StepTimeTracker ---------------------------------------------------------------
def test_speed_factor_follows_steps_slower_than_the_profile():
    tracker = StepTimeTracker(PROFILE, smoothing=0.1)
    rng = random.Random(0)
    for _ in range(200):
        batch = rng.choice([1, 2, 8, 32])
        # 3x the profile, with up to +-10% noise per step.
        tracker.observe(batch, 0, 0, 3.0 * PROFILE.step_time(batch, 0) * rng.uniform(0.9, 1.1))
    # A running mean of ratios in [2.7, 3.3] stays in that range; tolerance 0.3 (10%).
    assert tracker.speed_factor == pytest.approx(3.0, abs=0.3)
    curve = dict(tracker.curve(0, 48))
    assert sorted(curve) == [1, 2, 4, 8, 16, 32, 48]
    for batch, seconds in curve.items():
        assert seconds == pytest.approx(PROFILE.step_time(batch, 0) * tracker.speed_factor)


def test_a_profile_with_coverage_predicts_the_tokens_lookup_really_verifies():
    model = LatencyModel(target_coef=[0.010, 0.001, 0.0005], draft_coef=[0.0, 0.0])
    coverage = [0.5, 0.25]  # lookup proposes half the first positions asked for, a quarter of the rest
    tracker = StepTimeTracker(model, coverage, smoothing=0.1)
    curve = dict(tracker.curve(4, 8))
    # batch 8, k = 4: 1 + 0.5 + 3 * 0.25 = 2.25 tokens per request, not 5
    assert curve[8] == pytest.approx(0.010 + 8 * 0.001 + 0.0005 * 8 * 2.25)
    assert curve[8] < model.step_time(8, 4)
    # a step that took what the coverage predicts leaves the speed factor at 1
    tracker.observe(8, 4, 0, model.step_time(8, 4, coverage))
    assert tracker.speed_factor == pytest.approx(1.0)


def test_speed_factor_starts_at_the_first_ratio_and_then_smooths():
    tracker = StepTimeTracker(PROFILE, smoothing=0.1)
    assert tracker.speed_factor == 1.0
    tracker.observe(4, 0, 0, 3.0 * PROFILE.step_time(4, 0))
    assert tracker.speed_factor == pytest.approx(3.0)
    tracker.observe(4, 0, 0, PROFILE.step_time(4, 0))
    assert tracker.speed_factor == pytest.approx(0.9 * 3.0 + 0.1 * 1.0)


def test_prefill_steps_set_marginal_seconds_per_token_not_the_speed():
    tracker = StepTimeTracker(PROFILE, smoothing=0.5)
    # A step of 2 sequences with 100 prompt tokens: the profile gives 0.014 s to decoding
    # 2 sequences, so prefill took the rest.
    tracker.observe(2, 0, 100, 0.514)
    assert tracker.prefill_seconds_per_token == pytest.approx(0.005)
    tracker.observe(2, 0, 100, 1.514)
    assert tracker.prefill_seconds_per_token == pytest.approx(0.5 * 0.005 + 0.5 * 0.015)
    assert tracker.speed_factor == 1.0
    # Empty or zero-time steps are ignored.
    tracker.observe(0, 0, 0, 1.0)
    tracker.observe(3, 0, 0, 0.0)
    assert tracker.speed_factor == 1.0


def test_prefill_seconds_per_token_leave_out_decoding_at_the_measured_speed():
    # Decoding runs 2x the profile; a mixed step of 64 sequences (0.14 s of which is
    # decoding at that speed) and 512 prompt tokens that took 0.652 s: 1 ms per token.
    # The whole step over its prompt tokens would say 1.27 ms.
    tracker = tracker_at_speed(2.0)
    tracker.observe(64, 0, 512, 2 * PROFILE.step_time(64, 0) + 0.512)
    assert tracker.prefill_seconds_per_token == pytest.approx(0.001)


def test_without_a_profile_prefill_is_the_whole_step_until_a_line_is_fitted():
    tracker = StepTimeTracker(None, smoothing=1.0)
    tracker.observe(4, 0, 100, 0.5)
    assert tracker.prefill_seconds_per_token == pytest.approx(0.005)
    for batch in (1, 8):
        tracker.observe(batch, 0, 0, 0.020 + 0.003 * batch)
    tracker.observe(4, 0, 100, 0.5)  # the line gives 0.032 s to decoding 4 sequences
    assert tracker.prefill_seconds_per_token == pytest.approx(0.468 / 100)


def test_without_a_profile_the_curve_is_a_line_through_recent_steps():
    tracker = StepTimeTracker(None)
    assert tracker.curve(0, 16) == ()
    for batch in (1, 2, 4, 8, 16):
        for _ in range(3):
            tracker.observe(batch, 0, 0, 0.020 + 0.003 * batch)
    curve = dict(tracker.curve(0, 64))
    assert sorted(curve) == [1, 2, 4, 8, 16, 32, 64]
    for batch, seconds in curve.items():  # including beyond the batch sizes seen
        assert seconds == pytest.approx(0.020 + 0.003 * batch)


def test_without_a_profile_one_batch_size_gives_a_flat_line_at_the_mean():
    tracker = StepTimeTracker(None)
    for seconds in (0.01, 0.02, 0.03):
        tracker.observe(4, 0, 0, seconds)
    assert tracker.curve(0, 8) == ((1, pytest.approx(0.02)), (2, pytest.approx(0.02)),
                                   (4, pytest.approx(0.02)), (8, pytest.approx(0.02)))


def test_without_a_profile_predictions_never_fall_below_the_fastest_step():
    tracker = StepTimeTracker(None)
    # Faster with bigger batches (noise): the slope is clipped to 0 and nothing is
    # predicted faster than the fastest step measured.
    for batch, seconds in ((1, 0.05), (2, 0.04), (4, 0.03)):
        tracker.observe(batch, 0, 0, seconds)
    curve = tracker.curve(0, 16)
    assert all(seconds >= 0.03 for _, seconds in curve)
    assert len({round(s, 12) for _, s in curve}) == 1


def test_replicas_that_have_not_reported_still_share_the_group_load():
    # Four fast replicas, only one has reported: the group's load is spread over all
    # four, so the fast group keeps winning against one 3x slower replica.
    def share_of_slow(fast_size: int) -> int:
        router = GroupRouter({"fast": fast_size, "slow": 1}, "tandem", staleness_seconds=5.0, seed=0)
        router.observe(replica_stats("fast-1", "fast", speed=1.0))
        router.observe(replica_stats("slow-1", "slow", speed=3.0))
        return route(router, 60).count("slow")

    assert share_of_slow(4) < share_of_slow(1)


def test_choosing_among_no_known_group_is_a_clear_error():
    router = two_groups()
    with pytest.raises(ValueError, match="no known replica group"):
        router.choose({"other": REQUEST}, NOW)


def test_a_group_without_a_running_replica_is_left_out_while_another_can_serve():
    router = GroupRouter({"fast": 1, "slow": 1}, policy="pow2", seed=0)
    requests = {"fast": RoutingRequest(4, 4), "slow": RoutingRequest(4, 4)}
    router.set_unavailable({"fast"}, as_of=100.0)
    assert {router.choose(requests, 0.0) for _ in range(20)} == {"slow"}
    assert router.may_leave("fast", requests) and not router.may_leave("slow", requests)
    assert not router.may_leave("fast", {"fast": requests["fast"]})  # pinned: nowhere else to go
    router.set_unavailable({"fast", "slow"}, as_of=100.0)  # none can serve: the choice is as before
    assert {router.choose(requests, 0.0) for _ in range(40)} == {"fast", "slow"}
    assert not router.may_leave("fast", requests)
    assert router.snapshot()["unavailable"] == ["fast", "slow"]
    # Serve's view lags a replica that already answers: an acknowledgement from after the view puts
    # its group back at once, one from before does not.
    router.observe(replica_stats("fast-1", "fast", timestamp=99.0))
    assert router.unavailable == {"fast", "slow"}
    router.observe(replica_stats("fast-1", "fast", timestamp=101.0))
    assert router.unavailable == {"slow"}
