"""The simulator's step times against a ``tandem bench paper`` JSON (``cluster/sim/step_validation.py``):
the roofline's features, the fit of its figures, the per-cell errors and picks, and ``tandem sim --measured``
on the JSON of a real bench run of the tiny pair (no timing assertions)."""

from __future__ import annotations

import json

import pytest
import yaml

from cluster.cli import main
from cluster.sim.config import ModelFigures
from cluster.sim.device_model import DeviceFigures, Efficiency, StepModel, derive_latency_model
from cluster.sim.step_validation import (
    compare_steps, compare_traffic, fit_figures, is_paper_result, roofline_features,
)
from cluster.spec_decode.latency_model import expected_tokens
from test_sim_helpers import DEVICES, sim_config

TARGET = {"name": "t", "num_params_b": 0.281, "kv_bytes_per_token": 6144}
DRAFT = {"name": "d", "num_params_b": 0.0101, "kv_bytes_per_token": 2048}
CELLS = [(b, k) for b in (1, 4, 16, 32) for k in (0, 1, 3, 6)]


def _derived(bandwidth_gb_s: float, tflops: float, overhead_s: float, context_len: int, draft=True) -> StepModel:
    device = DeviceFigures(memory_bandwidth_gb_s=bandwidth_gb_s, bf16_tflops=tflops, memory_gb=24,
                           price_per_hour=0, source="test")
    eff = Efficiency(bandwidth=1.0, compute=1.0, step_overhead_s=overhead_s)
    latency = derive_latency_model(device, eff, ModelFigures(**TARGET), ModelFigures(**DRAFT) if draft else None,
                                   context_len)
    return StepModel(latency, (0.8,) * 6, 10**6, "derived: test", 0.0, 6)


@pytest.mark.parametrize("draft", [True, False])
def test_roofline_features_are_the_derived_models_step_times(draft):
    """bytes / bandwidth + FLOPs / FLOP rate + passes x overhead is the sim's own derived step time."""
    bandwidth, tflops, overhead, context = 30.0, 0.4, 0.002, 200
    model = _derived(bandwidth, tflops, overhead, context, draft)
    draft_figures = ModelFigures(**DRAFT) if draft else None
    for b, k in CELLS:
        reads, flops, passes = roofline_features(ModelFigures(**TARGET), draft_figures, context, b, k)
        predicted = reads / (bandwidth * 1e9) + flops / (tflops * 1e12) + passes * overhead
        assert predicted == pytest.approx(model.step_seconds(b, k, 0, 0), rel=1e-9)


def test_the_fit_recovers_the_figures_that_made_the_steps():
    target, draft = ModelFigures(**TARGET), ModelFigures(**DRAFT)
    model = _derived(21.0, 0.25, 0.004, 176)
    features = [roofline_features(target, draft, 176, b, k) for b, k in CELLS]
    fitted = fit_figures(features, [model.step_seconds(b, k, 0, 0) * 1e3 for b, k in CELLS])
    assert fitted.bandwidth_gb_s == pytest.approx(21.0, rel=1e-6)
    assert fitted.tflops == pytest.approx(0.25, rel=1e-6)
    assert fitted.step_overhead_ms == pytest.approx(4.0, rel=1e-6)


def _paper_json(step_ms) -> dict:
    """A bench paper result whose decoding steps took ``step_ms(b, k)``; one phased traffic run per policy."""
    cells = [{"batch_size": b, "k": k, "decode_step_ms": step_ms(b, k)} for b, k in CELLS]
    cells.append({"batch_size": 8, "k": 0, "decode_step_ms": None})  # a cell with no full-batch step is skipped
    runs = [{"policy": p, "mean_tpot_ms": t} for p, t in (("k=0", 30.0), ("k=3", 20.0), ("table", 19.0),
                                                          ("adaptive", 22.0))]
    return {"settings": {"profile_context_len": 176}, "tpot_vs_k": {"cells": cells},
            "traffic": {"workloads": [{"name": "uniform-2.00", "kind": "uniform", "phases": [{"rate": 2.0}],
                                       "runs": runs},
                                      {"name": "phased", "kind": "phased", "phases": [], "runs": runs}]}}


def _config(**overrides):
    return sim_config([{"name": "cpu", "device": "cpu", "max_num_seqs": 32}],
                      target=TARGET, draft=DRAFT, acceptance=[0.8] * 6, mean_context_len=999, **overrides)


def test_errors_and_picks_per_batch_against_a_derived_group():
    """Measured steps from a roofline with other figures: the table's figures miss them, the fit does not,
    and each side's k is the argmin of its own step times per token."""
    truth = _derived(21.0, 0.25, 0.004, 176)
    measured = _paper_json(lambda b, k: truth.step_seconds(b, k, 0, 0) * 1e3)
    assert is_paper_result(measured) and not is_paper_result({"runs": {}})
    config = _config()
    from cluster.sim.device_model import DeviceTable, group_step_model

    model = group_step_model(config, config.groups[0], DeviceTable.load(DEVICES))
    steps = compare_steps(measured, config, {"cpu": model})["cpu"]
    assert steps["context_len"] == 176  # the bench's context, not the config's 999
    assert len(steps["rows"]) == len(CELLS)
    for row in steps["rows"]:
        simulated = model.step_seconds(row["batch_size"], row["k"], 0, 0) * 1e3
        assert row["simulated_ms"] == pytest.approx(simulated)
        assert row["error"] == pytest.approx(simulated / row["measured_ms"] - 1)
        assert row["fitted_error"] == pytest.approx(0, abs=1e-6)
    assert steps["mean_abs_fitted_error"] == pytest.approx(0, abs=1e-6)
    assert steps["fitted_figures"]["bandwidth_gb_s"] == pytest.approx(21.0, rel=1e-6)
    for p in steps["per_batch"]:
        b = p["batch_size"]
        per_token = {k: truth.step_seconds(b, k, 0, 0) / expected_tokens([0.8] * 6, k) for k in (0, 1, 3, 6)}
        assert p["measured_k"] == p["fitted_k"] == min(per_token, key=per_token.get)
        rows = [r for r in steps["rows"] if r["batch_size"] == b]
        assert p["mean_abs_error"] == pytest.approx(sum(abs(r["error"]) for r in rows) / len(rows))
    assert steps["mean_abs_error"] > 0.05  # the table's cpu figures are not these


def test_a_measured_group_gets_no_fit():
    measured = _paper_json(lambda b, k: 10.0 + b + k)
    model = StepModel(_derived(21.0, 0.25, 0.004, 176).latency, (0.8,) * 6, 10**6, "measured: p.json", 0.0, 6)
    steps = compare_steps(measured, _config(), {"cpu": model})["cpu"]
    assert steps["fitted_figures"] is None and "fitted_error" not in steps["rows"][0]


def test_a_json_without_decoding_steps_is_refused():
    with pytest.raises(ValueError, match="no measured decoding steps"):
        compare_steps(_paper_json(lambda b, k: None), _config(), {"cpu": _derived(21.0, 0.25, 0.004, 176)})


def test_traffic_is_compared_on_the_matching_workload_with_each_sides_gaps():
    measured = _paper_json(lambda b, k: 1.0)
    summaries = [{"router": "tandem", "controller": c, "mean_tpot_ms": t}
                 for c, t in (("fixed:0", 33.0), ("fixed:3", 22.0), ("table", 24.2), ("adaptive", 22.0),
                              ("fixed:6", 18.0))]
    uniform = compare_traffic(measured, _config(), summaries)  # rate 1.0: no uniform run at that rate
    assert uniform is None
    phased = compare_traffic(measured, _config(workload={"phases": [{"rate": 2.0, "duration_s": 1.0}]}), summaries)
    assert phased["workload"] == "phased"
    rows = {r["controller"]: r for r in phased["rows"]}
    assert set(rows) == {"fixed:0", "fixed:3", "table", "adaptive"}  # fixed:6 was not measured
    assert rows["table"]["measured_gap"] == pytest.approx(19.0 / 20.0 - 1)
    assert rows["table"]["simulated_gap"] == pytest.approx(24.2 / 22.0 - 1)
    assert rows["fixed:0"]["error"] == pytest.approx(33.0 / 30.0 - 1)
    at_rate = compare_traffic(measured, _config(workload={"rate": 2.0}), summaries)
    assert at_rate["workload"] == "uniform-2.00"


def test_sim_measured_against_a_real_bench_paper_run_of_the_tiny_pair(tmp_path, monkeypatch, capsys):
    """`tandem bench paper --traffic none` times the tiny pair's steps; `tandem sim --measured` sets the
    derived model of the same shapes against them."""
    from cluster.bench.proportions import PAIRS

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    paper = tmp_path / "paper.json"
    assert main(["bench", "paper", "--proportions", "tiny", "--synthetic-acceptance", "0.8", "--prompt-len", "16",
                 "--batch-sizes", "1,2", "--ks", "0,2", "--max-k", "2", "--output-len", "6", "--traffic", "none",
                 "--max-num-seqs", "2", "--kv-cache-memory", "16MiB", "--json", str(paper)]) == 0
    result = json.loads(paper.read_text())
    assert result["settings"]["traffic"] == "none" and result["traffic"]["workloads"] == [] and result["goals"] == []

    def figures(shape, name):
        head_dim = shape.hidden_size // shape.num_heads
        return {"name": name, "num_params_b": shape.num_parameters() / 1e9, "bytes_per_param": 4,
                "kv_bytes_per_token": 2 * shape.num_layers * shape.num_kv_heads * head_dim * 4}

    pair = PAIRS["tiny"]
    config = {"name": "tiny-pair", "devices": DEVICES, "target": figures(pair.target, "target"),
              "draft": figures(pair.draft, "draft"), "acceptance": [0.8, 0.8],
              "groups": [{"name": "cpu", "device": "cpu", "max_num_seqs": 2}],
              "workload": {"rate": 5.0, "num_requests": 6, "input_len": 16, "output_len": 6},
              "routers": ["tandem"], "controllers": ["fixed:0", "fixed:2"], "scheduling": {"max_k": 2}}
    path = tmp_path / "tiny-pair.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "sim.json"
    capsys.readouterr()
    assert main(["sim", str(path), "--measured", str(paper), "--json", str(out), "--no-plots",
                 "--disable-tqdm"]) == 0
    printed = capsys.readouterr().out
    assert "Simulated step times against the engine's, group cpu" in printed
    validation = json.loads(out.read_text())["validation"]
    steps = validation["steps"]["cpu"]
    assert {(r["batch_size"], r["k"]) for r in steps["rows"]} == {(b, k) for b in (1, 2) for k in (0, 2)}
    assert all(r["measured_ms"] > 0 and r["simulated_ms"] > 0 for r in steps["rows"])
    assert steps["fitted_figures"] is not None and validation["traffic"] is None  # the bench ran no traffic


def test_sim_measured_refuses_a_missing_or_foreign_file(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"devices": DEVICES, "target": TARGET, "acceptance": [0.5],
                                      "groups": [{"name": "cpu", "device": "cpu"}],
                                      "workload": {"rate": 1.0, "num_requests": 3}, "routers": ["tandem"]}))
    assert main(["sim", str(config), "--measured", str(tmp_path / "nope.json"), "--no-plots",
                 "--json", str(tmp_path / "s.json")]) == 2
    assert "--measured" in capsys.readouterr().err
    (tmp_path / "list.json").write_text("[1, 2]")
    assert main(["sim", str(config), "--measured", str(tmp_path / "list.json"), "--no-plots",
                 "--json", str(tmp_path / "s.json")]) == 2
    assert "expected a JSON object" in capsys.readouterr().err


def test_a_device_entry_with_its_own_efficiency_is_derived_with_it(tmp_path):
    """The shipped `cpu-zen4-2core` entry gives effective rates (efficiency 1) and its own pass overhead;
    an entry without one takes the table's shares."""
    from cluster.sim.device_model import DeviceTable, group_step_model

    table = DeviceTable.load(DEVICES)
    own = table.devices["cpu-zen4-2core"]
    assert own.efficiency is not None and table.devices["cpu"].efficiency is None
    config = _config()
    weights = TARGET["num_params_b"] * 1e9 * 2
    for device, figures, eff in (("cpu-zen4-2core", own, own.efficiency),
                                 ("cpu", table.devices["cpu"], table.efficiency)):
        config.groups[0].device = device
        model = group_step_model(config, config.groups[0], table)
        c0 = weights / (figures.memory_bandwidth_gb_s * 1e9 * eff.bandwidth) + eff.step_overhead_s
        assert model.latency.target_coef[0] == pytest.approx(c0)
        assert model.latency.target_coef[2] == pytest.approx(
            2 * TARGET["num_params_b"] * 1e9 / (figures.bf16_tflops * 1e12 * eff.compute))
