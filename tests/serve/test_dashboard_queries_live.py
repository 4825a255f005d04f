"""Every series a Grafana dashboard queries shows up on a live cluster's Prometheus endpoints
(Tandem's at ``GET /metrics``, Ray Serve's own on Ray's metrics port), with the labels the
dashboard checker assumes it carries."""

from __future__ import annotations

import time

import httpx

from cluster.metrics.dashboard_check import SCRAPE_LABELS, known_series, selected_series
from cluster.metrics.dashboards import dashboards
from cluster.metrics.grafana_model import dashboard_queries
from tests.serve.conftest import API_KEY, MODEL, scrape_metrics

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_every_dashboard_series_is_in_the_live_scrape(server_url, serve_config, client):
    queried = {name for d in dashboards().values() for expr, _ in dashboard_queries(d)
               for name in selected_series(expr)}
    assert {"tandem:capacity_tokens_per_second", "ray_serve_num_http_error_requests_total"} <= queried
    for i in range(4):
        client.completions.create(model=MODEL, prompt=f"dashboards {i}", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    bad = httpx.post(f"{server_url}/v1/completions", headers=AUTH, timeout=60,
                     json={"model": MODEL, "prompt": "hi", "max_tokens": 0})
    assert bad.status_code == 400  # so Ray Serve's HTTP error counter has a series

    port = serve_config.serve.metrics_export_port
    deadline = time.time() + 120
    while True:
        series = scrape_metrics(port) | scrape_metrics(server_url)
        missing = sorted(queried - set(series))
        if not missing or time.time() > deadline:
            break
        time.sleep(2)
    assert not missing, f"queried by a dashboard but not exported: {missing}"

    known = known_series()
    for name in sorted(queried):
        for sample in series[name]:
            lacking = known[name] - set(sample.labels) - SCRAPE_LABELS  # those come with Prometheus' scrape
            assert not lacking, f"{name} lacks label(s) {sorted(lacking)} the dashboards may use: {sample.labels}"
    assert any(s.labels["error_code"] == "400" for s in series["ray_serve_num_http_error_requests_total"])
