"""The routing policy: predict what a request costs on each replica, rank by it.

Pure functions of the replica stats, the router's own in-flight counts, the request, a
clock reading ``now`` and a ``random.Random``: the same inputs and the same rng state
give the same ranking. Nothing here reads the clock or imports ray.

When every candidate has fresh, usable stats, replicas are ranked by the cost of
:func:`predict_completion_seconds`: the request's predicted completion time plus the
delay it adds to the requests already running there (lowest first; equal costs are
ordered at random so equal replicas share the load). When any candidate cannot be
predicted (no stats yet, stats older than ``staleness_seconds``, or no step-time curve),
costs are not comparable across the candidates and the router falls back to
:func:`power_of_two_choices` over all of them.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from operator import itemgetter
from types import MappingProxyType
from typing import Mapping, NamedTuple, Sequence

from cluster.routing.stats import Candidate, ReplicaStats, RoutingRequest

TIE_REL_TOL = 1e-9  # predictions this close (relatively) count as equal
_SIZE, _SECONDS = itemgetter(0), itemgetter(1)


class PredictedCost(NamedTuple):
    """The predicted seconds until a request finishes on one replica, by part (a
    NamedTuple: the router builds one per candidate per request)."""

    batch_size: int  # the batch the request would join (capped at max_num_seqs)
    step_seconds: float  # decoding step time at that batch size
    tokens_per_step: float  # expected tokens gained per request per step (E)
    matched_tokens: int  # prompt tokens found in the replica's prefix cache
    queue_seconds: float
    prefill_seconds: float
    decode_seconds: float
    affinity_seconds_saved: float  # prefill avoided thanks to the matched prefix
    total_seconds: float  # queue + prefill + decode: this request's own completion time
    delay_to_others_seconds: float = 0.0  # summed slow-down of the requests already running there
    cost_seconds: float = 0.0  # total + delay_to_others: what the ranking minimises
    adapter_load_seconds: float = 0.0  # loading the request's LoRA adapter there first (0: loaded)


class RankResult(NamedTuple):
    """Replica ids best first. ``predicted_seconds`` (each replica's ``cost_seconds``) and
    ``costs`` hold the predictions for the candidates whose stats were usable (all of
    them unless ``used_fallback``)."""

    replica_ids: tuple[str, ...]
    used_fallback: bool
    predicted_seconds: Mapping[str, float]
    costs: Mapping[str, PredictedCost]


# ---- the pieces of the cost model ---------------------------------------------------
def interpolate_step_time(curve: Sequence[tuple[int, float]], batch_size: float) -> float:
    """Seconds per step at ``batch_size`` from ``(batch size, seconds)`` points sorted by
    batch size: linear between points, the first point's time below the first point,
    and beyond the last point the line through the last two. That line's slope is taken
    as at least 0: a bigger batch is never predicted faster than the largest profiled one
    (a noisy profile must not extrapolate to negative times). Raises ValueError on an
    empty curve: the cost is then unknown."""
    if not curve:
        raise ValueError("the step-time curve is empty; the cost cannot be predicted")
    first_size, first_time = curve[0]
    if batch_size <= first_size:
        return first_time
    last_size, last_time = curve[-1]
    if batch_size >= last_size:
        if len(curve) == 1:
            return last_time
        prev_size, prev_time = curve[-2]
        slope = (last_time - prev_time) / (last_size - prev_size) if last_size > prev_size else 0.0
        return last_time + max(slope, 0.0) * (batch_size - last_size)
    i = bisect_left(curve, batch_size, key=_SIZE)
    hi_size, hi_time = curve[i]
    if hi_size == batch_size:
        return hi_time
    lo_size, lo_time = curve[i - 1]
    return lo_time + (hi_time - lo_time) * (batch_size - lo_size) / (hi_size - lo_size)


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """E = 1 + k * a: the expected tokens a request gains per speculative step with ``k``
    draft positions when a fraction ``a`` of them ends accepted (what native replicas
    report: accepted / positions asked for, an empty n-gram position counting as rejected).
    Exact for that definition of ``a``, whatever the per-position rates are: a step gains
    its accepted drafts plus the target's own token. E = 1 when k = 0; ``a`` is clipped to
    [0, 1]."""
    if k <= 0:
        return 1.0
    return 1.0 + k * min(max(acceptance, 0.0), 1.0)


def peak_tokens_per_second(curve: Sequence[tuple[int, float]], acceptance: float, k: int) -> float:
    """The most output tokens per second a replica can give over the batch sizes of its
    step-time ``curve``: max over b of b * E(a, k) / s(b). 0.0 when the curve is empty
    (nothing measured or profiled yet)."""
    tokens_per_step = expected_tokens_per_step(acceptance, k)
    return max((size * tokens_per_step / seconds for size, seconds in curve if seconds > 0), default=0.0)


def saturation_batch(curve: Sequence[tuple[int, float]], acceptance: float, k: int, share: float = 0.9) -> int | None:
    """The smallest batch size of the step-time ``curve`` whose output tokens/s reach ``share`` of the
    peak: past it a replica mostly adds latency, not throughput. None when the curve is empty."""
    peak = peak_tokens_per_second(curve, acceptance, k)
    if peak <= 0:
        return None
    tokens_per_step = expected_tokens_per_step(acceptance, k)
    return min(size for size, seconds in curve if seconds > 0 and size * tokens_per_step / seconds >= share * peak)


def replica_load(stats: ReplicaStats | None, num_inflight: int) -> int:
    """Requests at the replica: what it reported (running + waiting), or what this router
    has sent there and not seen finish, whichever is larger (the in-flight count covers
    requests sent after the stats were measured)."""
    if stats is None:
        return num_inflight
    return max(stats.num_running + stats.num_waiting, num_inflight)


def matched_prefix_tokens(request: RoutingRequest, stats: ReplicaStats) -> int:
    """Prompt tokens the replica would find in its prefix cache: (i + 1) * block_size for
    the deepest i with ``request.prefix_hashes[i]`` among the published hashes (names
    are chained, so a hit at i implies blocks 0..i are cached). Like the engine's lookup,
    it never covers the prompt's last token: at most (num_prompt_tokens - 1) //
    block_size blocks count."""
    cached = stats.cached_prefix_hashes
    if not cached or stats.block_size < 1:
        return 0
    max_blocks = max(0, (request.num_prompt_tokens - 1) // stats.block_size)
    hashes = request.prefix_hashes[:max_blocks]
    for i in range(len(hashes) - 1, -1, -1):
        if hashes[i] in cached:
            return (i + 1) * stats.block_size
    return 0


# ---- the cost model -----------------------------------------------------------------
def predict_completion_seconds(request: RoutingRequest, stats: ReplicaStats, num_inflight: int) -> PredictedCost:
    """Predicted seconds from routing ``request`` to ``stats``' replica until it finishes.

    * load L = max(num_running + num_waiting, num_inflight) (:func:`replica_load`); the
      request joins a batch of b = min(L + 1, max_num_seqs).
    * step time s(b) from ``step_time_curve`` (:func:`interpolate_step_time`), which is
      the replica's profile at its current k, already scaled by its speed factor.
    * E = 1 + k * a tokens per step for the accepted fraction a of the draft positions
      asked for (what replicas report) and k = current_k (:func:`expected_tokens_per_step`);
      decode = n / E * s(b) for the request's expected_output_tokens n.
    * prefill = (num_prompt_tokens - matched) * prefill_seconds_per_token, where
      matched is the cached prefix (:func:`matched_prefix_tokens`);
      affinity_seconds_saved = matched * prefill_seconds_per_token. A request whose LoRA
      adapter the replica has not loaded adds the replica's mean load time to its prefill, and
      so to the running requests' delay. vLLM loads between two steps, stalling them that
      long; Tandem's engine reads beside its loop and stalls them only for the stacking (7 of
      25 ms for SmolLM2 at rank 16), so for it the delay is overstated by the read.
    * queue: when L + 1 > max_num_seqs the request waits for excess = L + 1 - max_num_seqs
      slots to free up. Assuming the requests ahead are like this one (its prompt, its
      prefix hit, its n), a full replica spends on each of them its prefill
      (which runs serially, chunked into the steps) plus its share of the decoding steps,
      T / max_num_seqs with T = n / E * s(max_num_seqs); a slot frees every
      prefill + T / max_num_seqs seconds, so
      queue = excess * (prefill + T / max_num_seqs).
    * total = queue + prefill + decode.
    * delay to others: this request's prefill, chunked into the steps of the requests
      running when it starts, delays each of them by prefill: the L running now when it
      joins the batch directly, the max_num_seqs - 1 running then when it queues. Joining
      directly also makes each of the L take s(b) - s(b - 1) longer per step for about
      half of this request's decode steps (the requests ahead are assumed like this one,
      halfway done); a queued request keeps the batch at max_num_seqs. So
      delay = L * (prefill + (s(b) - s(b - 1)) * n / E / 2) when it joins, and
      (max_num_seqs - 1) * prefill when it queues.
    * cost = total + delay to others. Ranking by the request's own time alone piles
      requests onto the fastest replica until its queue explodes under heavy load (each
      choice is right for the request and wrong for the cluster); ranking by the whole
      added latency spreads them as capacity allows.

    Raises ValueError when the curve is empty or max_num_seqs < 1 (the cost is unknown;
    :func:`rank_replicas` falls back before calling this).
    """
    max_num_seqs, curve = stats.max_num_seqs, stats.step_time_curve
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    load = replica_load(stats, num_inflight)
    batch_size = min(load + 1, max_num_seqs)
    step_seconds = interpolate_step_time(curve, batch_size)
    tokens_per_step = expected_tokens_per_step(stats.acceptance, stats.current_k)
    decode_steps = request.expected_output_tokens / tokens_per_step
    decode_seconds = decode_steps * step_seconds

    matched = matched_prefix_tokens(request, stats)
    adapter_seconds = 0.0
    if request.lora is not None and request.lora not in stats.lora_adapters:
        adapter_seconds = stats.lora_load_seconds
    prefill_seconds = (request.num_prompt_tokens - matched) * stats.prefill_seconds_per_token + adapter_seconds
    saved = matched * stats.prefill_seconds_per_token

    excess = load + 1 - max_num_seqs
    queue_seconds = delay_to_others = 0.0
    if excess > 0:
        decode_share = decode_steps * interpolate_step_time(curve, max_num_seqs) / max_num_seqs
        queue_seconds = excess * (prefill_seconds + decode_share)
        delay_to_others = (max_num_seqs - 1) * prefill_seconds
    elif load > 0:
        slower_step = step_seconds - interpolate_step_time(curve, batch_size - 1)
        delay_to_others = load * (prefill_seconds + max(slower_step, 0.0) * (decode_steps / 2))
    total = queue_seconds + prefill_seconds + decode_seconds
    return PredictedCost(batch_size, step_seconds, tokens_per_step, matched, queue_seconds, prefill_seconds,
                         decode_seconds, saved, total, delay_to_others, total + delay_to_others, adapter_seconds)


# ---- ranking ------------------------------------------------------------------------
def stats_are_usable(stats: ReplicaStats | None, now: float, staleness_seconds: float) -> bool:
    """Stats a prediction can be made from: present, measured at most
    ``staleness_seconds`` before ``now``, with a step-time curve and max_num_seqs >= 1."""
    return (
        stats is not None
        and now - stats.timestamp <= staleness_seconds
        and bool(stats.step_time_curve)
        and stats.max_num_seqs >= 1
    )


def rank_replicas(
    request: RoutingRequest,
    candidates: list[Candidate],
    now: float,
    rng: random.Random,
    staleness_seconds: float = 5.0,
) -> RankResult:
    """Candidates best first by predicted cost (``cost_seconds``), or by power of two choices
    (``used_fallback``) when any candidate's stats are unusable (:func:`stats_are_usable`)
    or give a non-finite prediction. Predictions within ``TIE_REL_TOL`` of each other are
    ordered at random with ``rng``. An empty candidate list gives an empty ranking."""
    predicted = [
        (c.replica_id, predict_completion_seconds(request, c.stats, c.num_inflight))
        for c in candidates
        if stats_are_usable(c.stats, now, staleness_seconds)
    ]
    costs = MappingProxyType(dict(predicted))
    totals = MappingProxyType({replica_id: cost.cost_seconds for replica_id, cost in predicted})
    if len(predicted) < len(candidates) or not all(map(math.isfinite, totals.values())):
        return RankResult(tuple(power_of_two_choices(candidates, rng)), True, totals, costs)
    ranked = sorted([(replica_id, cost.cost_seconds) for replica_id, cost in predicted], key=_SECONDS)
    return RankResult(tuple(_shuffle_ties(ranked, rng)), False, totals, costs)


def _shuffle_ties(ranked: list[tuple[str, float]], rng: random.Random) -> list[str]:
    """Ids of ``ranked`` (sorted by seconds) with each run of equal seconds shuffled."""
    order = [replica_id for replica_id, _ in ranked]
    start, size = 0, len(ranked)
    while start < size - 1:
        seconds, end = ranked[start][1], start + 1
        while end < size and math.isclose(ranked[end][1], seconds, rel_tol=TIE_REL_TOL):
            end += 1
        if end - start > 1:
            group = order[start:end]
            rng.shuffle(group)
            order[start:end] = group
        start = end
    return order


def power_of_two_choices(candidates: list[Candidate], rng: random.Random) -> list[str]:
    """Two distinct candidates drawn at random, the less loaded first
    (:func:`replica_load`; the draw order breaks a tie), then all the others in random
    order so a caller can fall through. One candidate gives just it; none, nothing."""
    if len(candidates) <= 1:
        return [c.replica_id for c in candidates]
    i, j = rng.sample(range(len(candidates)), 2)
    pair = sorted((candidates[i], candidates[j]), key=lambda c: replica_load(c.stats, c.num_inflight))
    rest = [c.replica_id for n, c in enumerate(candidates) if n not in (i, j)]
    rng.shuffle(rest)
    return [pair[0].replica_id, pair[1].replica_id] + rest
