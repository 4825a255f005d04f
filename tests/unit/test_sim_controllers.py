"""The simulator's adaptive controller decides and learns exactly as the engine's does."""

import numpy as np
import pytest

from cluster.sim.controllers import SimAdaptiveController, build_controller
from cluster.spec_decode.controller import AdaptiveController, BatchState, FixedController, StepObservation, TableController
from cluster.spec_decode.latency_model import LatencyModel

PRIOR = LatencyModel([0.02, 0.0004, 0.0002], [0.003, 0.00005])


def test_same_observations_same_acceptance_model_and_choices():
    real = AdaptiveController(PRIOR, [0.7, 0.6, 0.5], max_k=6)
    sim = SimAdaptiveController(PRIOR, [0.7, 0.6, 0.5], max_k=6)
    rng = np.random.default_rng(1)
    for step in range(300):
        b = int(rng.integers(1, 64))
        state = BatchState(b, int(rng.integers(0, 5)))
        k = real.choose_k(state)
        assert sim.choose_k(state) == k, f"step {step}"
        seconds = PRIOR.step_time(b, k) * rng.uniform(0.8, 1.6)
        rate = 0.8 if step < 150 else 0.1  # acceptance collapses half-way: k must switch
        accepted = np.cumprod(rng.random((b, k)) < rate, axis=1) if k else None  # [b, k]
        real.observe(StepObservation(b, k, seconds, [(k, k, int(a)) for a in accepted.sum(axis=1)] if k else []))
        sim.observe_arrays(b, k, seconds, accepted)
        np.testing.assert_allclose(sim.acceptance, real.acceptance, rtol=1e-9, atol=1e-12)
        # The refit makes the same float operations: the same model to the last bit.
        assert sim.model.target_coef == real.model.target_coef and sim.model.draft_coef == real.model.draft_coef
        assert sim.model.step_time(b, k) == real.model.step_time(b, k)
    assert real.num_switches == sim.num_switches > 0


@pytest.mark.parametrize("name, kind", [("fixed:2", FixedController), ("table", TableController),
                                        ("adaptive", SimAdaptiveController)])
def test_build_controller(name, kind):
    controller = build_controller(name, PRIOR, [0.8], max_k=4, max_num_seqs=32)
    assert isinstance(controller, kind)
    assert 0 <= controller.choose_k(BatchState(8, 0)) <= 4


def test_the_refit_takes_off_the_draft_tokens_the_step_really_verified():
    # n-gram lookup proposes fewer than k: told the step's drafted count, the simulator's refit
    # is the engine's, to the last bit, and so is the choice that follows.
    real = AdaptiveController(PRIOR, [0.5], max_k=6, coverage=[0.6, 0.4])
    sim = SimAdaptiveController(PRIOR, [0.5], max_k=6, coverage=[0.6, 0.4])
    rng = np.random.default_rng(2)
    for step in range(300):
        state = BatchState(int(rng.integers(1, 64)), 0)
        k = real.choose_k(state)
        assert sim.choose_k(state) == k, f"step {step}"
        drafted = int(rng.integers(0, state.num_running * k + 1))
        seconds = PRIOR.step_time(state.num_running, k) * rng.uniform(0.8, 1.6)
        real.observe(StepObservation(state.num_running, k, seconds, [], drafted))
        sim.observe_arrays(state.num_running, k, seconds, None, drafted)
        assert sim.model.target_coef == real.model.target_coef and sim.model.draft_coef == real.model.draft_coef


def test_build_controller_passes_coverage_to_the_table_and_adaptive():
    model = LatencyModel([0.01, 0.0, 0.002], [0.0, 0.0])  # verified tokens cost; drafting is free
    table = build_controller("table", model, [0.6], max_k=6, max_num_seqs=4, coverage=[0.3])
    full = build_controller("table", model, [0.6], max_k=6, max_num_seqs=4)
    assert table.table == {b: model.best_k(b, [0.6], 6, [0.3]) for b in (1, 2, 4)}
    assert full.table == {b: model.best_k(b, [0.6], 6) for b in (1, 2, 4)}
    assert table.table != full.table  # cheaper verification: deeper k ({1: 4, 2: 3, 4: 3} against {1: 2, 2: 2, 4: 1})
    adaptive = build_controller("adaptive", model, [0.6], max_k=6, max_num_seqs=4, coverage=[0.3])
    assert adaptive.coverage == [0.3] * 6
