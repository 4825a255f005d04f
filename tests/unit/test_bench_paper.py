"""``tandem bench paper`` end to end on a tiny random Llama (no download, no timing assertions)."""

from __future__ import annotations

import json

import pytest

from cluster.bench.paper_traffic import Phase, phased_workload, poisson_arrivals, uniform_workload
from cluster.cli import main
from cluster.models.tiny import save_tiny_model, save_tiny_tokenizer, tiny_llama_config

POLICIES = ["k=0", "k=1", "k=2", "table", "adaptive"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    # The character-level tokenizer turns each passage prompt into ~500 tokens.
    save_tiny_model(tiny_llama_config(max_position_embeddings=2048), folder)
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def paper_run(tiny_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("paper")
    code = main(["bench", "paper", "--model", str(tiny_folder), "--dtype", "float32", "--batch-sizes", "1,2",
                 "--ks", "0,1,2", "--max-k", "2", "--output-len", "5", "--requests", "4", "--repeats", "2",
                 "--rates", "40,80",
                 # A batch limit above the 12 calibration prompts keeps the profile's acceptance run short.
                 "--max-num-seqs", "16", "--kv-cache-memory", "32MiB", "--json", str(out / "paper.json"),
                 "--plots", str(out / "plots")])
    assert code == 0
    return json.loads((out / "paper.json").read_text()), out / "plots"


def test_every_acceptance_prompt_set_has_a_description():
    from cluster.bench.paper import PROMPT_SETS
    from cluster.profiling.calibration import ACCEPTANCE_PROMPT_SETS

    # Every set the profiler measures acceptance on, and the benchmark workloads beside them.
    assert set(PROMPT_SETS) == set(ACCEPTANCE_PROMPT_SETS) | {"code", "agentic"}


def test_calibration_prompts_serve_every_calibration_request_per_cell(tiny_folder, tmp_path):
    from cluster.models.loader import load_tokenizer, resolve_model
    from cluster.profiling.calibration import CALIBRATION_PROMPTS

    out = tmp_path / "paper.json"
    code = main(["bench", "paper", "--model", str(tiny_folder), "--dtype", "float32", "--batch-sizes", "2",
                 "--ks", "0,1", "--max-k", "1", "--output-len", "3", "--requests", "2", "--rates", "40",
                 "--prompts", "calibration", "--max-num-seqs", "16", "--kv-cache-memory", "32MiB", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    settings = result["settings"]
    assert settings["prompts"] == "calibration" and "calibration chat requests" in settings["workload"]
    tokenizer = load_tokenizer(resolve_model(str(tiny_folder)))
    # The tiny tokenizer has no chat template: plain "User: ..." text.
    expected = [len(tokenizer.encode(f"User: {p}\n\nAssistant:")) for p in CALIBRATION_PROMPTS]
    assert settings["prompt_format"] == "plain" and settings["prompt_lens"] == expected
    assert settings["min_requests_per_cell"] == len(CALIBRATION_PROMPTS)
    for cell in result["tpot_vs_k"]["cells"]:
        # 12 prompts in whole rounds of 2: each served once.
        assert (cell["num_requests"], cell["output_tokens"]) == (len(CALIBRATION_PROMPTS), 3 * len(CALIBRATION_PROMPTS))


def test_tpot_vs_k_every_cell_with_a_prediction(paper_run):
    result, _ = paper_run
    sweep = result["tpot_vs_k"]
    cells = {(c["batch_size"], c["k"]): c for c in sweep["cells"]}
    assert set(cells) == {(b, k) for b in (1, 2) for k in (0, 1, 2)}
    for (b, k), cell in cells.items():
        # Every one of the 16 prompts once per cell, in whole rounds of b submitted at once.
        assert cell["num_requests"] == 16 and cell["output_tokens"] == 16 * 5
        assert cell["tpot_ms"] > 0 and cell["predicted_tpot_ms"] > 0
        assert cell["prediction_error"] == pytest.approx(cell["predicted_tpot_ms"] / cell["tpot_ms"] - 1)
        assert len(cell["conditional_acceptance"]) <= k
        if k == 0:
            assert cell["num_draft_tokens"] == 0
    assert [p["batch_size"] for p in sweep["per_batch"]] == [1, 2]
    for p in sweep["per_batch"]:
        assert p["best_k"] in (0, 1, 2) and p["model_k"] in (0, 1, 2)
        assert p["best_tpot_ms"] == min(cells[(p["batch_size"], k)]["tpot_ms"] for k in (0, 1, 2))
        assert p["model_k_regret"] >= 0
    assert isinstance(sweep["best_k_non_increasing"], bool)
    profile = result["profile"]
    assert profile["max_k"] == 2 and profile["batch_sizes"] == [1, 2] and len(profile["acceptance"]) == 2
    assert set(profile["table"]) == {"1", "2"}
    for p in sweep["per_batch"]:  # the table's pick and its regret, from the same cells
        b = p["batch_size"]
        assert p["table_k"] == profile["table"][str(b)]
        assert p["table_k_regret"] == pytest.approx(cells[(b, p["table_k"])]["tpot_ms"] / p["best_tpot_ms"] - 1)
    passes = {(b, n): t for b, n, t in profile["target_grid"]}
    for (b, k), cell in cells.items():  # the whole batch's decoding steps, against both models' step times
        assert cell["decode_steps"] > 0 and cell["decode_step_ms"] is not None  # counted, not a timing check
        for name in ("fit", "grid"):
            predicted = cell[f"predicted_step_ms_{name}"]
            assert cell[f"step_error_{name}"] == pytest.approx(predicted / cell["decode_step_ms"] - 1)
        if k == 0:  # plain decoding: the grid's own pass at one token per request
            assert cell["predicted_step_ms_grid"] == pytest.approx(passes[(b, 1)] * 1e3)
    for p in sweep["per_batch"]:
        row = [c for c in cells.values() if c["batch_size"] == p["batch_size"]]
        assert p["mean_abs_step_error_grid"] == pytest.approx(sum(abs(c["step_error_grid"]) for c in row) / len(row))


def test_traffic_every_policy_and_workload(paper_run):
    result, _ = paper_run
    assert result["capacity"]["source"] == "given by --rates (not used)"
    workloads = result["traffic"]["workloads"]
    assert [w["name"] for w in workloads] == ["uniform-40.00", "uniform-80.00", "phased"]
    assert [p["rate"] for p in workloads[2]["phases"]] == [40, 80, 40]
    assert [p["num_requests"] for p in workloads[2]["phases"]] == [1, 2, 1]
    assert result["traffic"]["policies"] == POLICIES
    for w in workloads:
        assert len(w["arrival_s"]) == 4 and w["arrival_s"] == sorted(w["arrival_s"])
        assert [r["policy"] for r in w["runs"]] == POLICIES
        for r in w["runs"]:
            assert r["workload"] == w["name"] and r["num_requests"] == 4 and r["output_tokens"] == 4 * 5
            # measured fields are present as numbers (their values are timings: not asserted)
            assert all(isinstance(r[key], float) for key in ("mean_tpot_ms", "mean_latency_s", "throughput_tok_s"))
            assert len(r["repeat_mean_tpot_ms"]) == 2  # --repeats 2 (which run is kept: the test below)
            assert len(r["phase_mean_tpot_ms"]) == len(w["phases"]) and 0 < r["prefill_step_share"] <= 1
            assert sum(r["k_per_step"].values()) > 0
            assert all(int(k) <= 2 for k in r["k_per_step"])
            if r["policy"].startswith("k="):
                assert set(r["k_per_step"]) == {r["policy"][2:]} and r["steps"] == []
            else:
                assert len(r["steps"]) == sum(r["k_per_step"].values())
        assert w["best_fixed"]["policy"] in POLICIES[:3]
        assert set(w["gaps"]) == {"table", "adaptive"} and min(r["gap_vs_best_fixed"] for r in w["runs"][:3]) == 0
    assert workloads[0]["phase_oracle"] is None and len(workloads[2]["phase_oracle"]["policies"]) == 3
    goals = result["goals"]
    assert [g["workload"] for g in goals][1:] == ["phased"] and all(isinstance(g["met"], bool) for g in goals)
    assert goals[1]["phase_oracle_gap"] == workloads[2]["phase_oracle"]["gap_vs_best_fixed"] <= 0


def test_plots_are_png_files(paper_run):
    _, plots = paper_run
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["phased_k_over_time.png", "tpot_vs_k.png", "traffic_tpot.png"]
    for name in names:
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_arrivals_are_seeded_and_phased():
    phases = (Phase(2.0, 3), Phase(10.0, 5))
    assert poisson_arrivals(phases, 7) == poisson_arrivals(phases, 7) != poisson_arrivals(phases, 8)
    # The same seed scales: a rate twice as high gives arrivals twice as early.
    slow, fast = uniform_workload(1.0, 6, 0), uniform_workload(2.0, 6, 0)
    assert fast.arrival_s == pytest.approx([t / 2 for t in slow.arrival_s])
    phased = phased_workload(1.0, 5.0, 10, 0)
    assert [(p.rate, p.num_requests) for p in phased.phases] == [(1.0, 2), (5.0, 6), (1.0, 2)]
    with pytest.raises(ValueError, match="rates must be > 0"):
        poisson_arrivals((Phase(0.0, 1),), 0)


@pytest.mark.parametrize("flag,value", [("--rates", "0,1"), ("--rates", "x"), ("--ks", "0,17"),
                                        ("--batch-sizes", "0"), ("--prompts", "chat")])
def test_bad_arguments_are_rejected(flag, value, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "paper", flag, value])
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and value in err


def test_workload_acceptance_replaces_the_calibration_one_and_resolves_the_table():
    from cluster.bench.paper_sweep import add_predictions, with_workload_acceptance
    from cluster.spec_decode.latency_model import LatencyModel
    from cluster.spec_decode.profile_data import SpeculationProfile

    model = LatencyModel([0.01, 0.001, 0.0005], [0.0002, 0.0001])
    calibration = [0.3, 0.3, 0.3, 0.3]
    profile = SpeculationProfile(device="cpu", target_model="t", draft="ngram", dtype="float32",
                                 tensor_parallel_size=1, max_k=4, batch_sizes=[1, 8], target_grid=[], draft_grid=[],
                                 acceptance=calibration, target_coef=model.target_coef, draft_coef=model.draft_coef,
                                 table={b: model.best_k(b, calibration, 4) for b in (1, 8)}, fit_error=0.0)
    cells = [{"k": 3, "effective_acceptance": [0.8, 0.9, 0.7], "coverage": [1.0, 0.8, 0.6]},  # the sweep's
             {"k": 3, "effective_acceptance": [0.6, 0.7, 0.9], "coverage": [0.8, 0.6, 0.4]},  # largest k, 2 sizes
             {"k": 1, "effective_acceptance": [0.1], "coverage": [0.1]}]  # a smaller k: not used
    updated = with_workload_acceptance(profile, cells)
    assert updated.acceptance == pytest.approx([0.7, 0.8, 0.8, 0.8])  # position 4 repeats position 3
    assert updated.coverage == pytest.approx([0.9, 0.7, 0.5, 0.5])
    assert updated.table == {b: model.best_k(b, updated.acceptance, 4, updated.coverage) for b in (1, 8)}
    assert updated.table != profile.table and profile.acceptance == calibration and profile.coverage is None
    assert (profile.acceptance_prompts, updated.acceptance_prompts) == ("calibration", "bench paper sweep")

    # The sweep's predictions use the acceptance the controllers start from (the replaced one).
    for cell, (b, tpot) in zip(cells, [(1, 20.0), (8, 30.0), (1, 25.0)]):
        cell.update(batch_size=b, tpot_ms=tpot)
    add_predictions(cells, updated)
    for cell in cells:
        b, k = cell["batch_size"], cell["k"]
        want = model.time_per_token(b, k, updated.acceptance, updated.coverage) * 1e3
        assert cell["predicted_tpot_ms"] == pytest.approx(want)
        assert cell["prediction_error"] == pytest.approx(want / cell["tpot_ms"] - 1)
        own = model.time_per_token(b, k, cell["effective_acceptance"], cell["coverage"]) * 1e3
        assert cell["predicted_tpot_ms_measured_acceptance"] == pytest.approx(own)


def _serve_with_fake_runs(monkeypatch, fake_run, workload, policies, repeats):
    """``paper._serve`` with every traffic run replaced by ``fake_run`` (no engine, no timing)."""
    import argparse

    from cluster.bench import paper

    class Progress:
        def update(self, *args, **kwargs):
            pass

        advance = update

    monkeypatch.setattr(paper, "run_open_loop", fake_run)
    monkeypatch.setattr(paper, "_controller", lambda policy, profile, max_k: None)
    args = argparse.Namespace(repeats=repeats, max_k=2, output_len=1)
    return paper._serve(type("E", (), {})(), workload, policies, None, [], args, Progress(), 0)


def test_repeats_rotate_the_policy_order_and_keep_each_policys_median_run(monkeypatch):
    """``_serve`` with the traffic runs replaced by fixed numbers (no timing involved)."""
    from cluster.bench.paper_traffic import RunResult

    tpot = {"k=1": [30.0, 10.0, 20.0], "k=2": [5.0, 6.0, 7.0], "adaptive": [9.0, 3.0, 4.0]}
    calls = []

    def fake_run(engine, workload, prompt_ids, output_len, policy):
        calls.append(policy)
        value = tpot[policy][sum(c == policy for c in calls) - 1]
        return RunResult(policy=policy, workload=workload.name, num_requests=1, output_tokens=1, duration_s=1.0,
                         mean_tpot_ms=value, mean_latency_s=1.0, mean_ttft_s=0.1, throughput_tok_s=1.0,
                         mean_batch_size=1.0, mean_k=0.0, k_per_step={}, acceptance_rate=None)

    result = _serve_with_fake_runs(monkeypatch, fake_run, uniform_workload(1.0, 1, 0), list(tpot), repeats=3)
    # Rounds start at position 0, 1 and 2 (3 policies spread over 3 rounds); the middle round
    # runs the list backwards, so adaptive follows k=2 in one round and precedes it in another.
    assert calls == ["k=1", "k=2", "adaptive", "k=2", "k=1", "adaptive", "adaptive", "k=1", "k=2"]
    runs = {r["policy"]: r for r in result["runs"]}
    assert {p: r["mean_tpot_ms"] for p, r in runs.items()} == {"k=1": 20.0, "k=2": 6.0, "adaptive": 4.0}
    assert runs["adaptive"]["repeat_mean_tpot_ms"] == [9.0, 3.0, 4.0]
    assert result["best_fixed"]["policy"] == "k=2" and result["gaps"]["adaptive"] == pytest.approx(4.0 / 6.0 - 1)
    # Run to run: k=1 spreads 30 / 10 - 1 = 200%, k=2 7 / 5 - 1 = 40%; the lower median of the
    # fixed k's (adaptive is not one).
    assert result["run_to_run"] == pytest.approx(0.4)


def test_the_phase_oracle_takes_each_phases_best_fixed_k(monkeypatch):
    """Per phase, the fixed k whose requests of that phase were fastest (fixed numbers, no timing)."""
    from cluster.bench.paper_traffic import RunResult

    per_phase = {"k=1": [10.0, 30.0, 10.0], "k=2": [14.0, 20.0, 14.0], "adaptive": [12.0, 21.0, 12.0]}
    workload = phased_workload(1.0, 5.0, 8, 0)  # 2, 4 and 2 requests
    weights = [p.num_requests for p in workload.phases]

    def fake_run(engine, workload, prompt_ids, output_len, policy):
        phases = per_phase[policy]
        return RunResult(policy=policy, workload=workload.name, num_requests=8, output_tokens=8, duration_s=1.0,
                         mean_tpot_ms=sum(w * t for w, t in zip(weights, phases)) / 8, mean_latency_s=1.0,
                         mean_ttft_s=0.1, throughput_tok_s=1.0, mean_batch_size=1.0, mean_k=0.0, k_per_step={},
                         acceptance_rate=None, phase_mean_tpot_ms=phases)

    result = _serve_with_fake_runs(monkeypatch, fake_run, workload, list(per_phase), repeats=1)
    assert result["best_fixed"]["policy"] == "k=2"  # 17 ms against k=1's 20
    oracle = result["phase_oracle"]
    assert oracle["policies"] == ["k=1", "k=2", "k=1"]  # the adaptive run is not a fixed k
    assert oracle["mean_tpot_ms"] == pytest.approx((2 * 10 + 4 * 20 + 2 * 10) / 8)
    assert oracle["gap_vs_best_fixed"] == pytest.approx(15 / 17 - 1)
    assert result["run_to_run"] is None  # one run per policy: no spread to measure


def test_goals_mark_a_miss_within_the_run_to_run_spread():
    """Fixed gaps and spreads, no timing: the worst uniform rate decides the uniform goal."""
    from cluster.bench.paper import _goals

    def workload(name, kind, adaptive, spread):
        return {"name": name, "kind": kind, "gaps": {"adaptive": adaptive, "table": 0.0}, "run_to_run": spread,
                "phase_oracle": None}

    uniform, phased = _goals([workload("uniform-1", "uniform", 0.01, 0.1), workload("uniform-4", "uniform", 0.05, 0.1),
                              workload("phased", "phased", -0.05, 0.02)])
    assert uniform["workload"] == "uniform-4" and not uniform["met"] and uniform["within_noise"]  # 3% over, 10% spread
    assert not phased["met"] and not phased["within_noise"]  # 4% short of 9% ahead, 2% spread
    uniform, = _goals([workload("uniform-1", "uniform", 0.05, None)])
    assert not uniform["met"] and not uniform["within_noise"]  # one run per policy: no spread measured
    # Met, but by less than the spread: 10% ahead against 9% with runs 15% apart.
    uniform, phased = _goals([workload("uniform-1", "uniform", 0.0, 0.15), workload("phased", "phased", -0.1, 0.15)])
    assert uniform["met"] and phased["met"] and uniform["within_noise"] and phased["within_noise"]
    uniform, phased = _goals([workload("uniform-1", "uniform", 0.0, 0.01), workload("phased", "phased", -0.2, 0.05)])
    assert uniform["met"] and phased["met"] and not uniform["within_noise"] and not phased["within_noise"]


def test_synthetic_acceptance_draws_every_accept_and_every_table_says_so(tiny_folder, tmp_path, capsys):
    out = tmp_path / "paper.json"
    code = main(["bench", "paper", "--model", str(tiny_folder), "--dtype", "float32", "--batch-sizes", "2",
                 "--ks", "0,2", "--max-k", "2", "--output-len", "6", "--requests", "2", "--rates", "40",
                 "--prompts", "calibration", "--max-num-seqs", "16", "--kv-cache-memory", "32MiB",
                 "--synthetic-acceptance", "1", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["settings"]["synthetic_acceptance"] == "synthetic acceptance α = 1"
    drafted = [c for c in result["tpot_vs_k"]["cells"] if c["k"] == 2 and c["acceptance_rate"] is not None]
    assert drafted and all(c["acceptance_rate"] == 1.0 for c in drafted)  # every draft accepted, as set
    printed = capsys.readouterr().out
    assert printed.count("synthetic acceptance α = 1") >= 4  # the sweep, best k, traffic and goals tables
