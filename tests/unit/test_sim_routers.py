"""Each simulated router policy on a crafted pair of replicas: a fast one and a slow one."""


import numpy as np
from test_sim_helpers import constant_model, workload

from cluster.routing.step_times import StepTimeTracker
from cluster.sim.replica import ReplicaSettings, SimReplica
from cluster.sim.requests import RequestTable
from cluster.sim.routers import build_router
from cluster.spec_decode.controller import FixedController

SETTINGS = ReplicaSettings(max_num_seqs=8, max_num_batched_tokens=2048, block_size=16, prefix_affinity_blocks=8,
                           stats_period_s=0.5)


def pair(table: RequestTable, fast_s=0.01, slow_s=0.1) -> list[SimReplica]:
    rng = np.random.default_rng(0)
    replicas = []
    for name, step in (("fast", fast_s), ("slow", slow_s)):
        model = constant_model(step, per_token_s=step / 100)
        replicas.append(SimReplica(f"{name}-{len(replicas)}", name, "x", model, FixedController(0),
                                   StepTimeTracker(model.latency), SETTINGS, table, rng))
    return replicas


def table_of(n=40, prefix_id=None, shared_len=None) -> RequestTable:
    return RequestTable(workload(np.zeros(n), 64, 32, prefix_id, shared_len))


def router(name, table):
    return build_router(name, 0, 32, table, SETTINGS, staleness_s=5.0)


def test_tandem_picks_the_fast_idle_replica_and_leaves_it_when_it_is_loaded():
    # Steps of 10 ms and 20 ms: idle, the fast one finishes 32 tokens first; with 39 requests
    # queued on it (32 ahead beyond its 8 slots, 1.7 s) the idle slow one (0.65 s) wins.
    table = table_of()
    fast, slow = pair(table, slow_s=0.02)
    tandem = router("tandem", table)
    assert all(tandem.choose([fast, slow], 0, now=0.0) is fast for _ in range(20))
    assert all(tandem.choose([slow, fast], 0, now=0.0) is fast for _ in range(20))
    for request in range(1, 40):  # fast full and queueing, slow idle: slow wins
        fast.enqueue(request)
    assert tandem.choose([fast, slow], 0, now=0.0) is slow


def test_pow2_prefers_the_less_loaded_replica_whatever_its_speed():
    table = table_of()
    fast, slow = pair(table)
    for request in range(5):
        fast.enqueue(request)
    pow2 = router("pow2", table)
    assert all(pow2.choose([fast, slow], 0, now=0.0) is slow for _ in range(20))


def test_round_robin_alternates():
    table = table_of()
    fast, slow = pair(table)
    rr = router("round-robin", table)
    assert [rr.choose([fast, slow], 0, 0.0).group for _ in range(4)] == ["fast", "slow", "fast", "slow"]


def test_prefix_affinity_follows_the_cached_prefix_and_ignores_load():
    # Request 0 carries prefix 3 (64 shared tokens); only the slow replica has it cached.
    table = table_of(prefix_id=[3] * 40, shared_len=[64] * 40)
    fast, slow = pair(table)
    slow.prefix_cache[3] = 64
    for request in range(1, 10):
        slow.enqueue(request)
    affinity = router("prefix-affinity", table)
    assert all(affinity.choose([fast, slow], 0, now=0.0) is slow for _ in range(20))
    # Without a match the choice is at random: both replicas are picked.
    table2 = table_of()
    fast2, slow2 = pair(table2)
    affinity2 = build_router("prefix-affinity", 0, 32, table2, SETTINGS, 5.0)
    picks = {affinity2.choose([fast2, slow2], 0, 0.0).group for _ in range(40)}
    assert picks == {"fast", "slow"}


def test_tandem_sees_load_only_through_stats_and_its_own_inflight_count():
    # Stats are refreshed every stats_period_s; the live load (in flight) still counts at once.
    table = table_of()
    fast, slow = pair(table, slow_s=0.02)
    tandem = router("tandem", table)
    fast.stats(0.0)  # published idle at t = 0
    for request in range(1, 40):
        fast.enqueue(request)
    assert fast.stats(0.1).num_waiting == 0  # not yet republished
    assert tandem.choose([fast, slow], 0, now=0.1) is slow  # the in-flight count covers it
