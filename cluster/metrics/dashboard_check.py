"""Checks that a dashboard only asks Prometheus for what Tandem and Ray Serve export.

Each PromQL expression is parsed with ``promql-parser`` (the ``test`` extra) after
Grafana's variables are replaced by harmless values, and its syntax tree is walked
to work out which labels every sub-expression's result carries. A problem is
reported when an expression

- selects a series that is neither in ``catalog.exported_series_names()`` nor in
  ``SERVE_METRICS`` (the few Ray Serve built-ins the dashboards use),
- matches on, groups by or shows in its legend (``{{label}}``) a label that the
  series underneath do not carry,
- divides (or otherwise combines) two vectors whose matching labels differ, which
  Prometheus answers with an empty result.

``label_values(selector, label)`` variable queries are checked the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from cluster.metrics.catalog import METRICS
from cluster.metrics.grafana_model import dashboard_queries

SERVE_LABELS = frozenset({"deployment", "replica", "application"})  # Ray Serve adds these to every replica metric
# Labels a scrape adds to every series: prometheus-operator's target labels, and the Ray
# cluster and worker group our PodMonitors copy from the pods (cluster/k8s/monitoring.py).
SCRAPE_LABELS = frozenset({"namespace", "pod", "container", "endpoint", "instance", "job", "ray_io_cluster",
                           "ray_group"})

# Ray Serve 2.60's own series the dashboards may query, with the labels Ray gives them
# (ray/serve/_private/request_ingress_metrics.py and deployment_state.py).
SERVE_METRICS: Mapping[str, frozenset[str]] = {
    "ray_serve_num_http_requests_total": frozenset({"route", "method", "application", "status_code"}),
    "ray_serve_num_http_error_requests_total": frozenset({"route", "method", "application", "error_code"}),
    "ray_serve_http_request_latency_ms_bucket": frozenset({"route", "method", "application", "status_code", "le"}),
    "ray_serve_deployment_replica_healthy": frozenset({"deployment", "application", "replica"}),
}

_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.*),\s*(?P<label>\w+)\s*\)\s*$", re.S)
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_GRAFANA_INTERVAL = re.compile(r"\$__\w+")
_GRAFANA_VARIABLE = re.compile(r"\$\{?\w+\}?")
_UNKNOWN = " is not a series Tandem exports nor one of the allowed Ray Serve metrics"


def known_series() -> dict[str, frozenset[str]]:
    """Series name -> the labels it carries: every catalog series, then ``SERVE_METRICS``."""
    series: dict[str, frozenset[str]] = {}
    for spec in METRICS:
        labels = frozenset(spec.all_labels) | SERVE_LABELS | SCRAPE_LABELS
        for name in spec.prometheus_names:
            series[name] = labels | {"le"} if name.endswith("_bucket") else labels
    return {**series, **{name: labels | SCRAPE_LABELS for name, labels in SERVE_METRICS.items()}}


def check_dashboard(dashboard: dict, known: Mapping[str, frozenset[str]] | None = None) -> list[str]:
    """Problems in every query of a rendered dashboard (an empty list when it is sound)."""
    known = known_series() if known is None else known
    return [f"{dashboard.get('uid')}: {problem}"
            for expr, legend in dashboard_queries(dashboard) for problem in check_query(expr, legend, known)]


def check_query(expr: str, legend: str = "", known: Mapping[str, frozenset[str]] | None = None) -> list[str]:
    """Problems with one query: a PromQL expression with its legend format, or a
    ``label_values(selector, label)`` variable query."""
    known = known_series() if known is None else known
    problems: list[str] = []
    match = _LABEL_VALUES.match(expr)
    promql = match["selector"] if match else expr
    try:
        tree = parse_grafana_promql(promql)
    except ValueError as err:
        return [f"{expr!r} does not parse: {err}"]
    result = _labels(tree, known, problems)
    unknown = [p for p in problems if p.endswith(_UNKNOWN)]
    if unknown:  # the labels of an unknown series say nothing more
        return [f"{expr!r}: {p}" for p in unknown]
    shown = {match["label"]} if match else set(_LEGEND_LABEL.findall(legend))
    missing = shown - (result or frozenset())
    if missing:
        problems.append(f"shows label(s) {sorted(missing)} that its result does not carry")
    return [f"{expr!r}: {p}" for p in problems]


def selected_series(expr: str) -> set[str]:
    """The names of the series a PromQL (or ``label_values``) query selects."""
    # here, not at the top: promql-parser is optional (the test extra)
    import promql_parser

    match = _LABEL_VALUES.match(expr)
    names: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(parse_grafana_promql(match["selector"] if match else expr), visit)
    return names


def parse_grafana_promql(expr: str):
    """Parse PromQL that may hold Grafana variables: ``$__rate_interval`` and the like
    become ``5m``, other ``$var`` / ``${var}`` (used inside label matchers) ``.*``."""
    # here, not at the top: promql-parser is optional (the test extra)
    import promql_parser

    plain = _GRAFANA_VARIABLE.sub(".*", _GRAFANA_INTERVAL.sub("5m", expr))
    return promql_parser.parse(plain)


def _labels(node, known: Mapping[str, frozenset[str]], problems: list[str]) -> frozenset[str] | None:
    """The labels of ``node``'s result (None for a scalar or string); appends problems."""
    # here, not at the top: promql-parser is optional (the test extra)
    import promql_parser as pp

    if isinstance(node, pp.VectorSelector):
        labels = known.get(node.name or "")
        if labels is None:
            problems.append(f"{node.name}{_UNKNOWN}")
            return frozenset()
        _require({m.name for m in node.matchers.matchers} - {"__name__"}, labels, f"{node.name} matcher", problems)
        return labels
    if isinstance(node, pp.MatrixSelector):
        return _labels(node.vector_selector, known, problems)
    if isinstance(node, (pp.ParenExpr, pp.UnaryExpr, pp.SubqueryExpr)):
        return _labels(node.expr, known, problems)
    if isinstance(node, pp.Call):
        results = [_labels(arg, known, problems) for arg in node.args if isinstance(arg, pp.Expr)]
        vectors = [r for r in results if r is not None]
        if node.func.name == "histogram_quantile":
            _require({"le"}, vectors[0], "histogram_quantile", problems)
            return vectors[0] - {"le"}
        return None if node.func.name == "scalar" or not vectors else vectors[0]
    if isinstance(node, pp.AggregateExpr):
        inner = _labels(node.expr, known, problems) or frozenset()
        modifier = node.modifier
        if modifier is None:
            return frozenset()
        if modifier.type == pp.AggModifierType.By:
            _require(set(modifier.labels), inner, "by", problems)
            return frozenset(modifier.labels)
        return inner - set(modifier.labels)
    if isinstance(node, pp.BinaryExpr):
        return _binary_labels(node, known, problems)
    return None  # number and string literals


def _binary_labels(node, known: Mapping[str, frozenset[str]], problems: list[str]) -> frozenset[str] | None:
    # here, not at the top: promql-parser is optional (the test extra)
    import promql_parser as pp

    lhs, rhs = _labels(node.lhs, known, problems), _labels(node.rhs, known, problems)
    if lhs is None or rhs is None:
        return lhs if rhs is None else rhs
    matching = node.modifier.matching if node.modifier else None
    if matching is not None and matching.type == pp.LabelModifierType.Include:
        _require(set(matching.labels), lhs & rhs, "on", problems)
        lhs_key = rhs_key = frozenset(matching.labels)
    else:
        ignored = set(matching.labels) if matching is not None else set()
        lhs_key, rhs_key = lhs - ignored, rhs - ignored
    if lhs_key != rhs_key:
        problems.append(f"the sides of '{node.op}' match on different labels ({sorted(lhs_key)} vs "
                        f"{sorted(rhs_key)}): nothing would match")
    card = node.modifier.card if node.modifier else None
    return rhs if card == pp.VectorMatchCardinality.OneToMany else lhs


def _require(wanted: Iterable[str], present: frozenset[str], where: str, problems: list[str]) -> None:
    missing = sorted(set(wanted) - present)
    if missing:
        problems.append(f"{where} uses label(s) {missing} that the series do not carry "
                        f"(they have {sorted(present)})")
