"""The router and the dashboards see the same statistics from both engines: the same
``ReplicaStats`` fields populated, the same metric series with the same labels, and a
client that goes away leaves neither engine busy."""

from __future__ import annotations

import time

import httpx

from cluster.metrics.catalog import METRICS
from cluster.routing.stats import ReplicaStats
from tests.serve.conftest import API_KEY, MODEL, scrape_metrics


def _send(server_url: str, group: str, n: int = 3) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Tandem-Group": group}
    for i in range(n):
        # past 128 tokens: vLLM on the CPU caches (and reports) 128-token blocks only when full
        prompt = "Count with me, slowly and in order: one two three four five six seven eight nine ten. " * 8
        body = {"model": MODEL, "prompt": f"{prompt} Item {i}:",
                "max_tokens": 12, "temperature": 0}
        assert httpx.post(f"{server_url}/v1/completions", json=body, headers=headers, timeout=300).status_code == 200


def _routing_stats(group: str) -> ReplicaStats:
    from ray import serve

    handle = serve.get_deployment_handle(f"replica-{group}", app_name="tandem-vllm-test")
    return ReplicaStats.from_dict(handle.record_routing_stats.remote().result())


def test_replica_stats_have_the_same_fields_populated(server_url):
    stats = {}
    for group in ("native", "vllm"):
        _send(server_url, group)
        stats[group] = _routing_stats(group)
    for group, s in stats.items():
        assert s.group == group and s.device_kind == "cpu" and s.max_num_seqs == 16, s
        assert 0.0 <= s.kv_cache_usage <= 1.0 and 0.0 <= s.acceptance <= 1.0, s
        assert s.current_k == 3, s  # n-gram with a fixed k of 3 in both
        assert s.step_time_curve and all(t > 0 for _, t in s.step_time_curve), s  # timed steps
        assert s.prefill_seconds_per_token > 0 and s.speed_factor > 0, s
    # The same prompts, named alike: vLLM's cached blocks (from its KV events) carry the names the
    # native engine gives its own, the ones the router matches prompts against.
    assert stats["native"].cached_prefix_hashes & stats["vllm"].cached_prefix_hashes


def test_both_groups_export_the_same_metric_series(server_url):
    for group in ("native", "vllm"):
        _send(server_url, group, n=2)
    deadline = time.time() + 120
    while True:  # the processes push their registries every few seconds
        series = scrape_metrics(server_url)
        names = {g: set() for g in ("native", "vllm")}
        for name, samples in series.items():
            for sample in samples:
                if sample.labels.get("group") in names:
                    keys = tuple(sorted(k for k in sample.labels if k not in ("replica", "deployment")))
                    names[sample.labels["group"]].add((name, keys))
        if names["native"] and names["native"] == names["vllm"] or time.time() > deadline:
            break
        time.sleep(2)
    replica_metrics = {n for m in METRICS if m.source == "replica" for n in m.prometheus_names}
    exported = {g: {n for n, _ in v} & replica_metrics for g, v in names.items()}
    assert exported["native"] == exported["vllm"], (exported["native"] ^ exported["vllm"])
    must = {"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total",
            "vllm:time_to_first_token_seconds_bucket", "vllm:spec_decode_num_draft_tokens_total",
            "tandem:spec_k", "tandem:capacity_tokens_per_second"}
    assert must <= exported["vllm"], must - exported["vllm"]


def test_a_client_that_goes_away_leaves_the_engine_idle(server_url, group):
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Tandem-Group": group}
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", f"{server_url}/v1/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert any(next(lines).startswith("data: {") for _ in range(4))
    deadline = time.time() + 60
    while True:
        engines = httpx.get(f"{server_url}/debug/engines", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
        engine = engines[group]
        if engine["num_running"] == 0 and engine["kv_cache_usage"] == 0.0 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert engine["num_running"] == 0 and engine["num_waiting"] == 0 and engine["kv_cache_usage"] == 0.0, engine
