"""Ray Serve's autoscaling in the simulator: delays, bounds, scale up under load and down after."""

import numpy as np
from test_sim_helpers import constant_model, run, sim_config, workload

from cluster.config_serve import AutoscalingConfig
from cluster.sim.autoscale import GroupAutoscaler


def test_decisions_wait_for_the_delays_and_respect_the_bounds():
    scaler = GroupAutoscaler(AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=2,
                                               upscale_delay_s=3, downscale_delay_s=5), period_s=1.0)
    assert scaler.desired(100) == 4 and scaler.desired(0) == 1 and scaler.desired(5) == 3
    # Up after more than 3 s of wanting it (the 4th decision), not before.
    assert [scaler.decide(6, 1) for _ in range(4)] == [1, 1, 1, 3]
    # A decision the other way resets the count.
    assert scaler.decide(6, 1) == 1 and scaler.decide(2, 1) == 1
    assert [scaler.decide(6, 1) for _ in range(4)] == [1, 1, 1, 3]
    # Down after more than 5 s.
    assert [scaler.decide(0, 3) for _ in range(6)] == [3] * 5 + [1]


def test_replicas_are_added_under_load_and_removed_after():
    # 60 s at ~3x one replica's capacity, then 200 s of silence.
    config = sim_config(
        [{"name": "a", "device": "H100", "max_num_seqs": 4,
          "autoscaling": {"min_replicas": 1, "max_replicas": 6, "target_ongoing_requests": 4,
                          "upscale_delay_s": 2, "downscale_delay_s": 20}}],
        workload={"phases": [{"rate": 30, "duration_s": 60}, {"rate": 0, "duration_s": 200}]},
        scheduling={"replica_startup_s": 5, "autoscale_period_s": 1.0})
    rng = np.random.default_rng(0)
    arrivals = np.sort(rng.uniform(0, 60, 1800))
    result = run(config, {"a": constant_model(0.04)}, workload(arrivals, 16, 10))  # ~10 req/s per replica
    lives = result.groups[0].lives
    assert not np.isnan(result.requests.finish_s).any()
    assert len(lives) >= 3  # scaled up
    assert all(life.ready_s - life.created_s == 5 for life in lives[1:])
    drained = [life for life in lives if life.draining]
    assert len(drained) == len(lives) - 1  # back to min_replicas
    last_finish = np.nanmax(result.requests.finish_s)
    after = [life for life in drained if life.stopped_s > last_finish]
    assert after  # some were removed once the load was gone ...
    # ... after the downscale delay (20 s of wanting fewer; the load ended a little before).
    assert all(life.stopped_s >= last_finish + 19 for life in after)
    # The survivor is paid until the end of the silent phase.
    assert [life.stopped_s for life in lives if not life.draining] == [260.0]
