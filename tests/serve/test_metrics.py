"""Every metric of the catalog reaches Ray's Prometheus endpoint, with its labels,
and the counters agree with the requests this test sends."""

from __future__ import annotations

import time

import httpx

from cluster.metrics.catalog import COMMON_LABELS, METRICS
from tests.serve.conftest import API_KEY, MODEL, scrape_metrics

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVE_LABELS = {"deployment", "replica", "application"}


def _total(samples, **labels) -> float:
    return sum(s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items()))


def test_every_catalog_metric_is_exported_with_its_labels(server_url, serve_config, client):
    port = serve_config.serve.metrics_export_port
    groups = {g.name for g in serve_config.serve.groups}
    before = scrape_metrics(port).get("ray_request_success_total", [])
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
        series = scrape_metrics(port)
        missing = sorted(set(wanted) - set(series))
        length = _total(series.get("ray_request_success_total", []), finished_reason="length")
        aborted = _total(series.get("ray_request_success_total", []), finished_reason="abort")
        # A group that has decoded has measured step times, so it predicts a capacity.
        capacity = {s.labels["group"]: s.value for s in series.get("ray_tandem_capacity_tokens_per_second", [])}
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
            assert set(spec.all_labels) <= labels, (name, sample.labels)
            if spec.source == "replica":
                assert SERVE_LABELS <= labels, (name, sample.labels)
                assert sample.labels["group"] in groups and sample.labels["device_kind"] == "cpu"
                assert sample.labels["deployment"] == f"replica-{sample.labels['group']}"
    assert {s.labels["group"] for s in series["ray_tandem_router_decisions_total"]} <= groups
    assert set(COMMON_LABELS) == {"group", "device_kind"}
    # Self-speculation accepts every draft token, in the slow group; the fast group also serves a LoRA
    # adapter, whose requests verify drafts the draft model made without it.
    drafted = _total(series["ray_spec_decode_num_draft_tokens_total"], group="slow")
    assert drafted > 0 and _total(series["ray_spec_decode_num_accepted_tokens_total"], group="slow") == drafted
    assert (_total(series["ray_spec_decode_num_accepted_tokens_total"], group="fast")
            <= _total(series["ray_spec_decode_num_draft_tokens_total"], group="fast"))
