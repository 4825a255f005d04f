"""StepTimeline.summary: the served-path figures are the arithmetic of the recorded loops."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from cluster.bench.served_report import print_served_report
from cluster.hosting.step_timeline import StepTimeline, TimelineEntry


def _entry(started, idle, step, execute, batch, tokens, outputs=None, k=0, prefill=0):
    return TimelineEntry(started, idle, 0.001, step, execute, 0.002, batch, tokens,
                         batch if outputs is None else outputs, k, prefill)


def test_summary_is_the_arithmetic_of_its_entries():
    timeline = StepTimeline()
    timeline.record(_entry(0.0, 0.0, 0.050, 0.045, 4, 4))
    timeline.record(_entry(0.053, 0.100, 0.030, 0.028, 2, 130, outputs=2, prefill=129))
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
    assert summary["prefill_step_fraction"] == 0.5 and summary["drafting_step_fraction"] == 0
    assert summary["mean_prefill_step_ms"] == pytest.approx(30) and summary["mean_decode_step_ms"] == pytest.approx(50)
    assert summary["mean_prefill_tokens_per_prefill_step"] == 129 and summary["mean_decode_batch_size"] == 4


def test_split_of_decode_only_steps_by_drafting():
    timeline = StepTimeline()
    timeline.record(_entry(0.0, 0.0, 0.040, 0.035, 8, 32, k=3))
    timeline.record(_entry(0.1, 0.0, 0.020, 0.018, 8, 8))
    timeline.record(_entry(0.2, 0.0, 0.030, 0.028, 8, 8))
    summary = timeline.summary()
    assert summary["prefill_step_fraction"] == 0 and summary["mean_prefill_step_ms"] is None
    assert summary["drafting_step_fraction"] == pytest.approx(1 / 3)
    assert summary["mean_decode_step_ms"] == pytest.approx(30) and summary["mean_decode_batch_size"] == 8


def test_window_keeps_the_last_seconds_and_capacity_bounds_memory():
    timeline = StepTimeline(capacity=3)
    for i in range(5):
        timeline.record(_entry(float(i), 0.0, 0.5, 0.4, 1, 1))
    assert len(timeline.entries) == 3 and len(timeline.recent(10)) == 3
    assert timeline.summary(last_seconds=1.6)["num_steps"] == 2  # loops from 2.903 on: 3.0 and 4.0 (end 4.503)
    assert StepTimeline().summary() == {"num_steps": 0}


def test_the_served_report_prints_the_split():
    timeline = StepTimeline()
    timeline.record(_entry(0.0, 0.0, 0.200, 0.190, 17, 145, outputs=17, prefill=128))
    timeline.record(_entry(0.3, 0.0, 0.030, 0.028, 17, 17))
    timeline.record(_entry(0.4, 0.0, 0.040, 0.038, 17, 51, k=2))
    figures = dict.fromkeys(["output_throughput", "request_throughput", "mean_ttft_ms", "p99_ttft_ms",
                             "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "mean_e2el_ms"], 1.0)
    report = {"systems": {"tandem": {"random @ 2/s": figures | {"engine_timeline": timeline.summary()}}}}
    out = io.StringIO()
    print_served_report(Console(file=out, width=240), report)
    assert ("33% of steps carried a prompt's chunk (200.0 ms, 128.0 prompt tokens), decode-only steps 35.0 ms at "
            "batch 17.0; 33% of steps verified drafts") in out.getvalue()
