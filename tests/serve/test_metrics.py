"""Every metric of the catalog reaches ``GET /metrics`` on the API port, with its labels, and
the counters agree with the requests this test sends."""

from __future__ import annotations

import time

import httpx

from cluster.metrics.catalog import COMMON_LABELS, METRICS, SOURCE_LABELS
from tests.serve.conftest import API_KEY, MODEL, scrape_metrics

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _total(samples, **labels) -> float:
    return sum(s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items()))


def test_every_catalog_metric_is_exported_with_its_labels(server_url, serve_config, client):
    groups = {g.name for g in serve_config.serve.groups}
    before = scrape_metrics(server_url).get("vllm:request_success_total", [])
    for i in range(4):
        client.completions.create(model=MODEL, prompt=f"metrics {i}", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    # Every group decodes at least once, so each has measured step times (test_engine_death has
    # replaced the slow group's replica by now, and the router may send it nothing above).
    for group in sorted(groups):
        client.completions.create(model=MODEL, prompt=f"metrics on {group}", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True}, extra_headers={"X-Tandem-Group": group})
    # One client that leaves mid-stream: an aborted request.
    body = {"model": MODEL, "prompt": "go away", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server_url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        next(response.iter_lines())

    wanted = {name: spec for spec in METRICS for name in spec.prometheus_names}
    deadline = time.time() + 90
    while True:
        series = scrape_metrics(server_url)
        missing = sorted(set(wanted) - set(series))
        length = _total(series.get("vllm:request_success_total", []), finished_reason="length")
        aborted = _total(series.get("vllm:request_success_total", []), finished_reason="abort")
        # A group that has decoded has measured step times, so it predicts a capacity.
        capacity = {s.labels["group"]: s.value for s in series.get("tandem:capacity_tokens_per_second", [])}
        done = (not missing and length >= _total(before, finished_reason="length") + 4 + len(groups)
                and aborted >= 1 and set(capacity) == groups and all(capacity.values()))
        if done or time.time() > deadline:
            break
        time.sleep(2)
    assert not missing, f"not exported: {missing}"
    assert length >= _total(before, finished_reason="length") + 4 + len(groups) and aborted >= 1
    assert set(capacity) == groups and all(capacity[g] > 0 for g in groups), capacity

    for name, spec in wanted.items():
        for sample in series[name]:
            labels = set(sample.labels)
            assert set(spec.all_labels) | set(SOURCE_LABELS) <= labels, (name, sample.labels)
            assert sample.labels["application"] == "tandem-test"
            if spec.source == "replica":
                assert sample.labels["group"] in groups and sample.labels["device_kind"] == "cpu"
                assert sample.labels["deployment"] == f"replica-{sample.labels['group']}"
                assert sample.labels["model_name"] == MODEL
    assert {s.labels["group"] for s in series["tandem:router_decisions_total"]} <= groups
    assert set(COMMON_LABELS) == {"model_name", "group", "device_kind"}
    # The LoRA info the Gateway API Inference Extension reads: one series per replica serving adapters.
    info = series["vllm:lora_requests_info"]
    assert {s.labels["group"] for s in info} == {"fast"} and len(info) == len({s.labels["replica"] for s in info})
    assert all(s.labels["max_lora"] == "2" for s in info)  # the fast group's model.max_loras
    # Each replica's series once: no two samples of a series share their labels.
    for name, samples in series.items():
        keys = [tuple(sorted(s.labels.items())) for s in samples]
        assert len(keys) == len(set(keys)), name
    # Self-speculation accepts every draft token, in the slow group; the fast group also serves a LoRA
    # adapter, whose requests verify drafts the draft model made without it.
    drafted = _total(series["vllm:spec_decode_num_draft_tokens_total"], group="slow")
    assert drafted > 0 and _total(series["vllm:spec_decode_num_accepted_tokens_total"], group="slow") == drafted
    assert (_total(series["vllm:spec_decode_num_accepted_tokens_total"], group="fast")
            <= _total(series["vllm:spec_decode_num_draft_tokens_total"], group="fast"))
