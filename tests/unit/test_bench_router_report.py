"""``tandem bench router``'s tables come from its saved result alone (``tandem bench show``);
the run itself needs a Ray cluster and is left to the operator's machine."""

from __future__ import annotations

import json

from cluster.cli import main


def _summary(median_ttft: float, throughput: float) -> dict:
    return {"median_ttft_ms": median_ttft, "p99_ttft_ms": 2 * median_ttft, "median_e2el_ms": 100.0,
            "p99_e2el_ms": 200.0, "median_tpot_ms": 5.0, "p99_tpot_ms": 9.0, "request_throughput": 1.0,
            "output_throughput": throughput, "failed": 0}


def test_show_prints_a_saved_router_result(tmp_path, capsys):
    result = {"config": {"num_prompts": 8, "request_rate": 2.0, "burstiness": 1.0, "input_len": 16,
                         "output_len": 16},
              "groups": [{"name": "fast", "step_time_scale": 1.0}, {"name": "slow", "step_time_scale": 3.0}],
              "runs": {"tandem": {"summary": _summary(20.0, 64.0), "share": {"fast": 0.75, "slow": 0.25}},
                       "pow2": {"summary": _summary(40.0, 32.0), "share": {"fast": 0.5, "slow": 0.5}}},
              "run": {"benchmark": "router"}}
    path = tmp_path / "router.json"
    path.write_text(json.dumps(result))
    assert main(["bench", "show", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "fast (step x1), slow (step x3)" in printed
    ttft = next(line for line in printed.splitlines() if "TTFT median" in line)
    assert ttft.split()[-3:] == ["20", "40", "0.5"]  # tandem, pow2, tandem / pow2
    share = next(line for line in printed.splitlines() if "share to fast" in line)
    assert "75%" in share and "50%" in share
