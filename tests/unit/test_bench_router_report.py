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
    assert "fast (1 x native, step x1), slow (1 x native, step x3)" in printed
    ttft = next(line for line in printed.splitlines() if "TTFT median" in line)
    assert ttft.split()[-3:] == ["20", "40", "0.5"]  # tandem, pow2, tandem / pow2
    share = next(line for line in printed.splitlines() if "share to fast" in line)
    assert "75%" in share and "50%" in share


def test_a_conversation_run_shows_first_and_later_turns_and_cache_hits(tmp_path, capsys):
    def run(later_ttft: float, hit_rate: float) -> dict:
        turns = {"first_turns": _summary(100.0, 8.0), "later_turns": _summary(later_ttft, 8.0)}
        turns["later_turns"]["mean_ttft_ms"] = later_ttft
        return {"summary": _summary(50.0, 8.0), "turns": turns, "share": {"vllm": 1.0},
                "prefix_cache": {"queries": 100.0, "hits": 100 * hit_rate, "hit_rate": hit_rate}}

    result = {"config": {"workload": "agentic", "conversations": 6, "concurrent_conversations": 2,
                         "think_time": 0.0, "output_len": 16},
              "groups": [{"name": "vllm", "num_replicas": 2, "backend": "vllm", "step_time_scale": 1.0}],
              "runs": {"tandem": run(300.0, 0.8), "pow2": run(900.0, 0.6)}, "run": {"benchmark": "router"}}
    path = tmp_path / "router.json"
    path.write_text(json.dumps(result))
    assert main(["bench", "show", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "vllm (2 x vllm, step x1); 6 agentic conversations, 2 at a time" in " ".join(printed.split())
    later = next(line for line in printed.splitlines() if "TTFT later turns median" in line)
    assert later.split()[-3:] == ["300", "900", "0.333"]
    hits = next(line for line in printed.splitlines() if "prefix cache hits" in line)
    assert hits.split()[-2:] == ["80%", "60%"]


def test_prefix_cache_counters_sum_vllms_series_over_replicas():
    from deployments.bench_router import prefix_cache_counters

    exposition = "\n".join([
        "# TYPE vllm:prefix_cache_queries counter",
        'vllm:prefix_cache_queries_total{replica="a"} 300.0',
        'vllm:prefix_cache_queries_total{replica="b"} 100.0',
        "# TYPE vllm:prefix_cache_hits counter",
        'vllm:prefix_cache_hits_total{replica="a"} 250.0',
        'vllm:prefix_cache_hits_total{replica="b"} 50.0', ""])
    assert prefix_cache_counters(exposition) == {"queries": 400.0, "hits": 300.0, "hit_rate": 0.75}
    assert prefix_cache_counters("# TYPE tandem_x counter\ntandem_x_total 3\n") is None
