"""The routing policy: the cost model against hand-computed numbers, the ranking, the
fallback to power of two choices, and random tie-breaking."""

from __future__ import annotations

import random

import pytest

from cluster.routing.policy import (
    peak_tokens_per_second,
    expected_tokens_per_step,
    interpolate_step_time,
    power_of_two_choices,
    predict_completion_seconds,
    rank_replicas,
)
from cluster.routing.stats import Candidate, ReplicaStats, RoutingRequest

NOW = 1000.0
# Seconds per step = 0.009 + 0.001 * b on [1, 16] (slope 0.001 on both segments).
FAST_CURVE = ((1, 0.010), (8, 0.017), (16, 0.025))
SLOW_CURVE = tuple((b, 3 * t) for b, t in FAST_CURVE)  # 0.027 + 0.003 * b
REQUEST = RoutingRequest(num_prompt_tokens=50, expected_output_tokens=100)


def _stats(replica_id: str, curve=FAST_CURVE, num_running: int = 0, num_waiting: int = 0, **kw) -> ReplicaStats:
    values = dict(
        replica_id=replica_id, group="g", device_kind="cpu", timestamp=NOW - 1.0,
        num_running=num_running, num_waiting=num_waiting, max_num_seqs=16, kv_cache_usage=0.0,
        current_k=0, acceptance=0.0, step_time_curve=curve, prefill_seconds_per_token=0.001,
        block_size=16,
    )
    values.update(kw)
    return ReplicaStats(**values)


def _load(num: int) -> dict:
    """num_running / num_waiting for ``num`` requests at a replica with max_num_seqs 16."""
    return {"num_running": min(num, 16), "num_waiting": max(0, num - 16)}


# ---- the step-time curve ------------------------------------------------------------
def test_step_time_interpolates_clamps_below_and_extrapolates_beyond():
    curve = ((2, 0.010), (4, 0.014), (8, 0.030))
    assert interpolate_step_time(curve, 1) == pytest.approx(0.010)  # clamped to the first point
    assert interpolate_step_time(curve, 2) == pytest.approx(0.010)
    assert interpolate_step_time(curve, 3) == pytest.approx(0.012)  # halfway 0.010 -> 0.014
    assert interpolate_step_time(curve, 4) == pytest.approx(0.014)
    assert interpolate_step_time(curve, 6) == pytest.approx(0.022)  # 0.014 + 2 * 0.016 / 4
    assert interpolate_step_time(curve, 8) == pytest.approx(0.030)
    assert interpolate_step_time(curve, 10) == pytest.approx(0.038)  # last slope 0.004 per seq


def test_step_time_edge_curves():
    assert interpolate_step_time(((4, 0.02),), 1) == pytest.approx(0.02)
    assert interpolate_step_time(((4, 0.02),), 64) == pytest.approx(0.02)
    # A noisy profile whose last segment falls does not extrapolate downwards.
    assert interpolate_step_time(((1, 0.02), (2, 0.01)), 5) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="empty"):
        interpolate_step_time((), 1)


# ---- the cost model -----------------------------------------------------------------
def test_prediction_parts_by_hand():
    cost = predict_completion_seconds(REQUEST, _stats("a", num_running=2), num_inflight=0)
    assert cost.batch_size == 3
    assert cost.step_seconds == pytest.approx(0.012)
    assert cost.decode_seconds == pytest.approx(1.2)  # 100 tokens * 0.012 s
    assert cost.prefill_seconds == pytest.approx(0.05)  # 50 tokens * 0.001 s
    assert cost.queue_seconds == 0.0
    assert cost.total_seconds == pytest.approx(1.25)


def test_inflight_count_covers_requests_sent_after_the_stats():
    cost = predict_completion_seconds(REQUEST, _stats("a", num_running=1), num_inflight=4)
    assert cost.batch_size == 5
    assert cost.decode_seconds == pytest.approx(1.4)  # 100 * 0.014


def test_slower_replica_with_equal_load_ranks_below():
    fast, slow = _stats("fast", num_running=2), _stats("slow", SLOW_CURVE, num_running=2)
    result = rank_replicas(REQUEST, [Candidate("slow", slow), Candidate("fast", fast)], NOW, random.Random(0))
    assert result.replica_ids == ("fast", "slow")
    assert not result.used_fallback
    # Own time 1.25 s; the 2 running requests wait for the 0.05 s prefill and then take
    # 0.001 s longer for ~50 steps: 2 * (0.05 + 0.05) = 0.2 s added to them.
    assert result.costs["fast"].total_seconds == pytest.approx(1.25)
    assert result.costs["fast"].delay_to_others_seconds == pytest.approx(0.2)
    assert result.predicted_seconds["fast"] == pytest.approx(1.45)
    # Slow: 100 * 0.036 + 0.05 = 3.65 s, and 2 * (0.05 + 0.003 * 50) = 0.4 s to the others.
    assert result.predicted_seconds["slow"] == pytest.approx(4.05)


def test_load_on_the_fast_replica_crosses_over_where_the_formula_says():
    # Slow, idle: 100 * 0.030 + 0.05 = 3.05 s, delaying nobody.
    # Fast with L running (L <= 15): own 100 * (0.010 + 0.001 L) + 0.05 = 1.05 + 0.1 L, and
    # L * (0.05 + 0.001 * 50) = 0.1 L added to the others: cost 1.05 + 0.2 L, equal to the
    # slow replica's at L = 10. Ranking by own time alone would keep choosing fast up to
    # L = 19 (own time 2.55 s at L = 15, then queueing).
    slow = Candidate("slow", _stats("slow", SLOW_CURVE))
    winners = {}
    for load in (8, 9, 11, 12):
        fast = Candidate("fast", _stats("fast", **_load(load)))
        winners[load] = rank_replicas(REQUEST, [fast, slow], NOW, random.Random(load)).replica_ids[0]
    assert winners == {8: "fast", 9: "fast", 11: "slow", 12: "slow"}
    at_10 = predict_completion_seconds(REQUEST, _stats("fast", **_load(10)), 0)
    assert at_10.total_seconds == pytest.approx(2.05) and at_10.delay_to_others_seconds == pytest.approx(1.0)
    assert at_10.cost_seconds == pytest.approx(3.05)
    # A full batch: the request queues for L - 15 = 4 slots, each freed after a request's
    # 0.05 s prefill and its 2.5 / 16 s share of the decoding steps; when admitted, its
    # prefill delays the 15 requests then running (the batch stays at 16).
    at_19 = predict_completion_seconds(REQUEST, _stats("fast", **_load(19)), 0)
    assert at_19.queue_seconds == pytest.approx(4 * (0.05 + 2.5 / 16))
    assert at_19.total_seconds == pytest.approx(0.825 + 0.05 + 2.5)
    assert at_19.batch_size == 16 and at_19.delay_to_others_seconds == pytest.approx(15 * 0.05)


def test_queue_counts_the_prefill_of_the_requests_ahead():
    # A fast decoder with a full batch, 4 requests queued and slow prefill (0.5 s per
    # 50-token prompt), against an idle replica that decodes 4x slower: 100 * 0.040 +
    # 0.05 = 4.05 s. Counting only the decode share of the requests ahead, the queue
    # would be 4 * 2.5 / 16 = 0.625 s and the busy replica would look cheaper (3.625 s).
    busy = _stats("busy", prefill_seconds_per_token=0.01, **_load(19))
    idle = _stats("idle", tuple((b, 4 * t) for b, t in FAST_CURVE))
    cost = predict_completion_seconds(REQUEST, busy, 0)
    assert cost.queue_seconds == pytest.approx(4 * (0.5 + 2.5 / 16))
    assert cost.total_seconds == pytest.approx(2.625 + 0.5 + 2.5)
    assert cost.delay_to_others_seconds == pytest.approx(15 * 0.5)
    result = rank_replicas(REQUEST, [Candidate("busy", busy), Candidate("idle", idle)], NOW, random.Random(0))
    assert result.replica_ids == ("idle", "busy")
    assert result.predicted_seconds["idle"] == pytest.approx(4.05)


def test_prefix_affinity_wins_and_saves_matched_prefill():
    request = RoutingRequest(num_prompt_tokens=50, expected_output_tokens=100, prefix_hashes=(11, 12, 13))
    cold = _stats("cold", num_running=2, cached_prefix_hashes=frozenset({99}))
    warm = _stats("warm", num_running=2, cached_prefix_hashes=frozenset({11, 12, 99}))
    result = rank_replicas(request, [Candidate("cold", cold), Candidate("warm", warm)], NOW, random.Random(0))
    assert result.replica_ids == ("warm", "cold")
    cost = result.costs["warm"]
    assert cost.matched_tokens == 32
    assert cost.affinity_seconds_saved == pytest.approx(0.032)  # 32 tokens * 0.001 s
    assert cost.prefill_seconds == pytest.approx(0.018)  # the other 18 tokens
    # The saved prefill counts for the request and for each of the 2 requests running there.
    assert result.predicted_seconds["cold"] - result.predicted_seconds["warm"] == pytest.approx(0.032 * 3)


def test_a_replica_with_the_adapter_loaded_is_spared_its_load_time():
    """A LoRA request: the replica without the adapter pays its mean load time (0.2 s) on the prefill,
    for the request and for the 2 requests running there; a base request, or a replica that has
    measured no load yet, costs the same on both."""
    request = RoutingRequest(num_prompt_tokens=50, expected_output_tokens=100, lora="sql")
    cold = _stats("cold", num_running=2, lora_adapters=frozenset({"chat"}), lora_load_seconds=0.2)
    warm = _stats("warm", num_running=2, lora_adapters=frozenset({"sql"}), lora_load_seconds=0.2)
    candidates = [Candidate("cold", cold), Candidate("warm", warm)]
    result = rank_replicas(request, candidates, NOW, random.Random(0))
    assert result.replica_ids == ("warm", "cold")
    assert (result.costs["cold"].adapter_load_seconds, result.costs["warm"].adapter_load_seconds) == (0.2, 0.0)
    assert result.costs["cold"].prefill_seconds - result.costs["warm"].prefill_seconds == pytest.approx(0.2)
    assert result.predicted_seconds["cold"] - result.predicted_seconds["warm"] == pytest.approx(0.2 * 3)
    costs = rank_replicas(REQUEST, candidates, NOW, random.Random(0)).predicted_seconds
    assert costs["cold"] == pytest.approx(costs["warm"])
    unmeasured = [Candidate("cold", _stats("cold", num_running=2)), Candidate("warm", warm)]
    costs = rank_replicas(request, unmeasured, NOW, random.Random(0)).predicted_seconds
    assert costs["cold"] == pytest.approx(costs["warm"])


def test_replica_stats_round_trip_through_a_dict():
    stats = _stats("r", lora_adapters=frozenset({"b", "a"}), lora_load_seconds=0.3,
                   cached_prefix_hashes=frozenset({5, 1}))
    data = stats.to_dict()
    assert data["lora_adapters"] == ["a", "b"] and ReplicaStats.from_dict(data) == stats


def test_prefix_match_takes_the_deepest_hash_and_leaves_the_last_token():
    request = RoutingRequest(num_prompt_tokens=50, expected_output_tokens=10, prefix_hashes=(11, 12, 13))
    # Names are chained: a hit on block 1 means blocks 0..1 are cached, even unpublished.
    only_deep = _stats("a", cached_prefix_hashes=frozenset({12}))
    assert predict_completion_seconds(request, only_deep, 0).matched_tokens == 32
    skipping = _stats("a", cached_prefix_hashes=frozenset({11, 13}))
    assert predict_completion_seconds(request, skipping, 0).matched_tokens == 48
    # A 48-token prompt whose 3 blocks are all cached: like the engine, the last block is
    # recomputed so its last token gets logits ((48 - 1) // 16 = 2 blocks count).
    exact = RoutingRequest(num_prompt_tokens=48, expected_output_tokens=10, prefix_hashes=(11, 12, 13))
    full = _stats("a", cached_prefix_hashes=frozenset({11, 12, 13}))
    cost = predict_completion_seconds(exact, full, 0)
    assert cost.matched_tokens == 32
    assert cost.prefill_seconds == pytest.approx(0.016)


def test_acceptance_lowers_decode_time_by_the_expected_tokens_per_step():
    # k = 3: half of the drafts accepted -> 1 + 1.5 tokens a step; 80% -> 1 + 2.4.
    assert expected_tokens_per_step(0.5, 3) == pytest.approx(2.5)
    assert expected_tokens_per_step(0.8, 3) == pytest.approx(3.4)
    assert expected_tokens_per_step(1.0, 3) == 4.0
    assert expected_tokens_per_step(0.0, 3) == 1.0
    assert expected_tokens_per_step(0.9, 0) == 1.0
    low = _stats("low", num_running=2, current_k=3, acceptance=0.5)
    high = _stats("high", num_running=2, current_k=3, acceptance=0.8)
    plain = _stats("plain", num_running=2, current_k=0, acceptance=0.8)
    assert predict_completion_seconds(REQUEST, low, 0).decode_seconds == pytest.approx(1.2 / 2.5)
    assert predict_completion_seconds(REQUEST, high, 0).decode_seconds == pytest.approx(1.2 / 3.4)
    assert predict_completion_seconds(REQUEST, plain, 0).decode_seconds == pytest.approx(1.2)
    result = rank_replicas(REQUEST, [Candidate(s.replica_id, s) for s in (plain, low, high)], NOW, random.Random(0))
    assert result.replica_ids == ("high", "low", "plain")


# ---- fallback -----------------------------------------------------------------------
def test_missing_stats_fall_back_to_power_of_two_by_load():
    fresh = Candidate("fresh", _stats("fresh", num_running=5))
    unknown = Candidate("unknown", None, num_inflight=2)
    for seed in range(20):
        result = rank_replicas(REQUEST, [fresh, unknown], NOW, random.Random(seed))
        assert result.used_fallback
        assert result.replica_ids == ("unknown", "fresh")  # load 2 before load 5
        assert set(result.predicted_seconds) == {"fresh"}


@pytest.mark.parametrize("broken", [
    {"timestamp": NOW - 5.5},  # older than the 5 s staleness
    {"step_time_curve": ()},
])
def test_stale_stats_or_no_curve_fall_back(broken):
    good = Candidate("good", _stats("good", num_running=3))
    bad = Candidate("bad", _stats("bad", **broken), num_inflight=1)
    result = rank_replicas(REQUEST, [good, bad], NOW, random.Random(0))
    assert result.used_fallback and result.replica_ids == ("bad", "good")


def test_stats_exactly_at_the_staleness_limit_are_fresh():
    a = Candidate("a", _stats("a", timestamp=NOW - 5.0))
    assert not rank_replicas(REQUEST, [a], NOW, random.Random(0)).used_fallback
    assert rank_replicas(REQUEST, [a], NOW, random.Random(0), staleness_seconds=4.0).used_fallback


def test_power_of_two_orders_the_sampled_pair_by_load_and_keeps_the_rest():
    candidates = [
        Candidate("idle", _stats("idle")),  # load 0
        Candidate("inflight", None, num_inflight=3),  # load 3
        Candidate("busy", _stats("busy", num_running=2, num_waiting=4), num_inflight=1),  # load 6
        Candidate("crowded", _stats("crowded", num_running=1), num_inflight=9),  # load 9 (max of both)
    ]
    load = {"idle": 0, "inflight": 3, "busy": 6, "crowded": 9}
    firsts = set()
    for seed in range(200):
        order = power_of_two_choices(candidates, random.Random(seed))
        assert sorted(order) == sorted(load)
        assert load[order[0]] < load[order[1]]
        firsts.add(order[0])
    assert "crowded" not in firsts  # the most loaded never wins a comparison
    assert firsts == {"idle", "inflight", "busy"}
    assert power_of_two_choices(candidates[:1], random.Random(0)) == ["idle"]
    assert power_of_two_choices([], random.Random(0)) == []


# ---- ties and determinism -----------------------------------------------------------
def test_ties_are_split_between_equal_replicas():
    a, b = Candidate("a", _stats("a", num_running=2)), Candidate("b", _stats("b", num_running=2))
    rng = random.Random(7)
    firsts = [rank_replicas(REQUEST, [a, b], NOW, rng).replica_ids[0] for _ in range(1000)]
    assert 400 < firsts.count("a") < 600


def test_near_ties_are_shuffled_but_real_differences_are_not():
    a = Candidate("a", _stats("a", num_running=2))
    nearly = Candidate("nearly", _stats("nearly", num_running=2, prefill_seconds_per_token=0.001 * (1 + 1e-12)))
    slower = Candidate("slower", _stats("slower", num_running=2, prefill_seconds_per_token=0.0011))
    rng = random.Random(3)
    orders = {rank_replicas(REQUEST, [slower, a, nearly], NOW, rng).replica_ids for _ in range(200)}
    assert orders == {("a", "nearly", "slower"), ("nearly", "a", "slower")}


def test_same_rng_state_gives_the_same_rankings():
    candidates = [Candidate(r, _stats(r, num_running=2)) for r in "abcd"]

    def rankings(seed: int) -> list[tuple[str, ...]]:
        rng = random.Random(seed)
        return [rank_replicas(REQUEST, candidates, NOW, rng).replica_ids for _ in range(50)]

    first = rankings(5)
    assert first == rankings(5)
    assert len(set(first)) > 1


def test_peak_tokens_per_second_is_the_best_batch_size_by_hand():
    curve = [(1, 0.02), (8, 0.04), (32, 0.16)]  # 50, 200 and 200 requests-steps/s
    assert peak_tokens_per_second(curve, acceptance=0.0, k=0) == pytest.approx(200.0)
    # k = 2 with half the drafts accepted: E = 1 + 2 * 0.5 = 2 tokens per request-step.
    assert peak_tokens_per_second(curve, acceptance=0.5, k=2) == pytest.approx(400.0)
    assert peak_tokens_per_second([], acceptance=0.5, k=2) == 0.0
