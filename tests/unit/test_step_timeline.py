"""StepTimeline.summary: the served-path figures are the arithmetic of the recorded loops."""

from __future__ import annotations

import pytest

from cluster.engine.step_timeline import StepTimeline, TimelineEntry


def _entry(started, idle, step, execute, batch, tokens, outputs=None):
    return TimelineEntry(started, idle, 0.001, step, execute, 0.002, batch, tokens,
                         batch if outputs is None else outputs, 0)


def test_summary_is_the_arithmetic_of_its_entries():
    timeline = StepTimeline()
    timeline.record(_entry(0.0, 0.0, 0.050, 0.045, 4, 4))
    timeline.record(_entry(0.053, 0.100, 0.030, 0.028, 2, 130, outputs=2))
    summary = timeline.summary()
    wall = 0.053 + 0.100 + 0.001 + 0.030 + 0.002  # the second loop ends here
    assert summary["num_steps"] == 2
    assert summary["wall_seconds"] == pytest.approx(wall)
    assert summary["busy_fraction"] == pytest.approx(0.080 / wall)
    assert summary["idle_fraction"] == pytest.approx(0.100 / wall)
    assert summary["mean_batch_size"] == 3 and summary["mean_tokens_per_step"] == 67
    assert summary["mean_python_around_forward_ms"] == pytest.approx(3.5)
    assert summary["mean_handoff_ms"] == pytest.approx(3.0)
    assert summary["output_tokens_per_second"] == pytest.approx(6 / wall)


def test_window_keeps_the_last_seconds_and_capacity_bounds_memory():
    timeline = StepTimeline(capacity=3)
    for i in range(5):
        timeline.record(_entry(float(i), 0.0, 0.5, 0.4, 1, 1))
    assert len(timeline.entries) == 3 and len(timeline.recent(10)) == 3
    assert timeline.summary(last_seconds=1.6)["num_steps"] == 2  # loops from 2.903 on: 3.0 and 4.0 (end 4.503)
    assert StepTimeline().summary() == {"num_steps": 0}
