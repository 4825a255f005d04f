"""The Grafana dashboards: committed files equal the generator's output, every query asks
only for series (and labels) that Tandem or Ray Serve export, and the checker that says
so does catch bad queries."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from cluster.metrics.catalog import exported_series_names
from cluster.metrics.dashboard_check import SERVE_METRICS, check_dashboard, check_query, selected_series
from cluster.metrics.dashboards import (CONFIGMAP_PATH, DASHBOARD_DIR, DASHBOARDS, OVERVIEW, REPLICAS, ROUTER,
                                        configmap_yaml, dashboard_json, dashboards)
from cluster.metrics.grafana_model import GRID_WIDTH, Panel, Query, Variable, build_dashboard, dashboard_queries

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = ("regenerate with: tandem dashboards render --out k8s/grafana "
              "--configmap k8s/monitoring/grafana-dashboards-configmap.yaml")


def test_committed_dashboards_equal_the_generated_ones():
    generated = dashboards()
    assert sorted(p.name for p in (ROOT / DASHBOARD_DIR).glob("*.json")) == sorted(generated), REGENERATE
    for name, dashboard in generated.items():
        assert (ROOT / DASHBOARD_DIR / name).read_text() == dashboard_json(dashboard), f"{name}: {REGENERATE}"


def test_committed_configmap_equals_the_generated_one_and_carries_every_dashboard():
    text = (ROOT / CONFIGMAP_PATH).read_text()
    assert text == configmap_yaml(), REGENERATE
    manifest = yaml.safe_load(text)
    assert manifest["apiVersion"] == "v1" and manifest["kind"] == "ConfigMap"
    assert manifest["metadata"]["labels"]["grafana_dashboard"] == "1"  # a string, as label values must be
    assert {name: json.loads(body) for name, body in manifest["data"].items()} == dashboards()
    assert len(text.encode()) < 1024 * 1024  # a ConfigMap holds at most 1 MiB


@pytest.mark.parametrize("spec", DASHBOARDS, ids=lambda s: s.uid)
def test_every_query_selects_exported_series_with_their_labels(spec):
    dashboard = build_dashboard(spec)
    assert check_dashboard(dashboard) == []
    allowed = exported_series_names() | set(SERVE_METRICS)
    for expr, _ in dashboard_queries(dashboard):
        assert selected_series(expr) and selected_series(expr) <= allowed, expr


def test_the_dashboards_query_what_the_issue_asks_for():
    series = {spec.uid: set().union(*(selected_series(e) for e, _ in dashboard_queries(build_dashboard(spec))))
              for spec in DASHBOARDS}
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
            "vllm:e2e_request_latency_seconds_bucket", "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
            "vllm:request_success_total", "ray_serve_num_http_error_requests_total"} <= series["tandem-overview"]
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "tandem:spec_k",
            "tandem:spec_k_table", "tandem:spec_acceptance_estimate", "vllm:num_preemptions_total",
            "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"} <= series["tandem-replicas"]
    router = {"tandem:router_decisions_total", "tandem:capacity_tokens_per_second"}
    assert router <= series["tandem-router"]


@pytest.mark.parametrize("spec", DASHBOARDS, ids=lambda s: s.uid)
def test_dashboard_structure(spec):
    dashboard = build_dashboard(spec)
    assert dashboard["uid"] == spec.uid and len(spec.uid) <= 40 and dashboard["id"] is None
    variables = dashboard["templating"]["list"]
    assert variables[0]["name"] == "datasource" and variables[0]["type"] == "datasource"
    for variable in variables[1:]:
        assert variable["query"].startswith("label_values(") and variable["datasource"]["uid"] == "${datasource}"
    panels = dashboard["panels"]
    assert [p["id"] for p in panels] == list(range(1, len(panels) + 1))
    cells = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= GRID_WIDTH
        area = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
    assert len({s.uid for s in DASHBOARDS}) == len(DASHBOARDS)


def test_replica_dashboard_filters_by_group_device_kind_and_replica():
    names = [v.name for v in REPLICAS.variables]
    assert names == ["cluster", "namespace", "application", "group", "device_kind", "replica"]
    labels = {"cluster": "ray_io_cluster"}
    for expr, _ in dashboard_queries(build_dashboard(REPLICAS)):
        if not expr.startswith("label_values"):
            assert all(f'{labels.get(name, name)}=~"${name}"' in expr for name in names), expr


@pytest.mark.parametrize("spec", DASHBOARDS, ids=lambda s: s.uid)
def test_every_query_is_scoped_to_one_cluster_namespace_and_application(spec):
    """Two Ray clusters side by side (an upgrade, two namespaces) never mix in one panel."""
    assert [v.name for v in spec.variables][:3] == ["cluster", "namespace", "application"]
    scope = ('ray_io_cluster=~"$cluster"', 'namespace=~"$namespace"', 'application=~"$application"')
    for expr, _ in dashboard_queries(build_dashboard(spec)):
        if not expr.startswith("label_values"):
            assert all(part in expr for part in scope), expr


# ---- the checker catches bad queries ---------------------------------------------------------

def _with_query(spec, expr, legend=""):
    """``spec`` with one more panel running ``expr``."""
    extra = Panel("extra", "a panel under test", (Query(expr, legend),))
    return build_dashboard(dataclasses.replace(spec, items=(*spec.items, extra)))


def test_checker_catches_a_misspelled_metric_in_a_dashboard():
    misspelled = 'sum by (group) (rate(vllm:generation_token_total{group=~"$group"}[$__rate_interval]))'
    dashboard = _with_query(OVERVIEW, misspelled, "{{group}}")
    problems = check_dashboard(dashboard)
    assert len(problems) == 1 and "vllm:generation_token_total is not a series" in problems[0]
    assert check_dashboard(_with_query(OVERVIEW, "vllm:num_requests_running_total")) != []  # a gauge has no _total
    histogram_base = "rate(vllm:time_to_first_token_seconds[5m])"  # a histogram is only _bucket/_sum/_count
    assert check_dashboard(_with_query(OVERVIEW, histogram_base)) != []


def test_checker_catches_a_misspelled_variable_query():
    variable = Variable("group", "Group", "label_values(ray_num_request_running, group)")
    bad = dataclasses.replace(ROUTER, variables=(variable,))
    assert any("ray_num_request_running is not a series" in p for p in check_dashboard(build_dashboard(bad)))
    assert check_query("label_values(vllm:num_requests_running, gpu)") != []


@pytest.mark.parametrize("expr, legend, says", [
    ('sum by (gpu) (vllm:num_requests_running)', "", "['gpu']"),
    ('vllm:num_requests_running{gpu="H100"}', "", "['gpu']"),
    ('sum by (group) (vllm:num_requests_running)', "{{replica}}", "['replica']"),
    ('sum by (group) (tandem:router_decisions_total{device_kind="cpu"})', "", "['device_kind']"),
    ('ray_serve_num_http_requests_total{group="a"}', "", "['group']"),
    ('histogram_quantile(0.9, sum by (group) (rate(vllm:e2e_request_latency_seconds_bucket[5m])))', "", "['le']"),
    ('sum by (group) (rate(vllm:generation_tokens_total[5m])) / sum(rate(vllm:generation_tokens_total[5m]))', "",
     "match on different labels"),
    ('sum by (group) (vllm:num_requests_running) / on (replica) sum by (group) (vllm:num_requests_waiting)', "",
     "['replica']"),
    ('sum(rate(vllm:generation_tokens_total[5m]', "", "does not parse"),
])
def test_checker_catches_labels_the_series_do_not_carry(expr, legend, says):
    problems = check_query(expr, legend)
    assert problems and says in " ".join(problems), problems


@pytest.mark.parametrize("expr, legend", [
    ('sum by (group) (rate(tandem:router_decisions_total[$__rate_interval])) / ignoring (group) group_left '
     'sum(rate(tandem:router_decisions_total[$__rate_interval]))', "{{group}}"),
    ('histogram_quantile(0.5, sum by (le, group) (rate(vllm:time_to_first_token_seconds_bucket[5m])))',
     "{{group}}"),
    ('sum without (replica) (vllm:num_requests_running{device_kind=~"${device_kind}"})', "{{deployment}}"),
    ('vllm:kv_cache_usage_perc > 0.9', "{{replica}}"),
])
def test_checker_accepts_sound_queries(expr, legend):
    assert check_query(expr, legend) == []
