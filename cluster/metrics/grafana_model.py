"""A compact description of a Grafana dashboard, and its rendering to Grafana's JSON model.

A dashboard is a ``DashboardSpec``: template variables and a flat list of ``Row``s and
``Panel``s. ``build_dashboard`` lays the panels out left to right on Grafana's 24-column
grid (a ``Row`` starts a new line) and numbers them in order, so the same spec always
renders to the same JSON: panel ids and the dashboard's ``uid`` are stable, which lets
provisioning and ``tandem dashboards push`` overwrite a dashboard in place.

Every query runs against the Prometheus data source chosen by the ``datasource``
template variable (``${datasource}``), which every rendered dashboard carries first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
PANEL_HEIGHT = 8
SCHEMA_VERSION = 39  # Grafana 10.4 / 11; later versions migrate it on load
TAG = "tandem"


@dataclass(frozen=True)
class Query:
    """One PromQL target. ``legend`` is Grafana's legend format (``{{label}}`` placeholders)."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    """A time series panel, or with ``matrix`` set a table of the queries' latest values.

    ``matrix=(row_label, column_label)`` pivots an instant query into a table with one
    row per value of ``row_label`` and one column per value of ``column_label``
    (numbers sorted numerically). ``right_axis`` and ``dashed`` are regular expressions
    over the legend: matching series are drawn against a right-hand axis in
    ``right_unit``, or dashed.
    """

    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    width: int = 12
    matrix: tuple[str, str] | None = None
    right_axis: str | None = None
    right_unit: str = "short"
    dashed: str | None = None


@dataclass(frozen=True)
class Row:
    title: str


@dataclass(frozen=True)
class Variable:
    """A multi-value template variable filled from ``label_values(selector, label)``."""

    name: str
    label: str
    query: str


@dataclass(frozen=True)
class DashboardSpec:
    uid: str
    title: str
    description: str
    items: tuple[Panel | Row, ...]
    variables: tuple[Variable, ...] = field(default_factory=tuple)


def build_dashboard(spec: DashboardSpec) -> dict:
    """Grafana's JSON model of ``spec`` (what the HTTP API and file provisioning take)."""
    return {
        "id": None,
        "uid": spec.uid,
        "title": spec.title,
        "description": spec.description,
        "tags": [TAG],
        "editable": True,
        "graphTooltip": 1,  # shared crosshair
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "version": 1,
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "tags": [TAG], "title": "Tandem", "asDropdown": False,
                   "includeVars": False, "keepTime": True}],
        "templating": {"list": [_datasource_variable(), *(_query_variable(v) for v in spec.variables)]},
        "panels": _layout(spec.items),
    }


def _datasource_variable() -> dict:
    return {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1,
            "regex": "", "skipUrlSync": False}


def _query_variable(variable: Variable) -> dict:
    return {"name": variable.name, "label": variable.label, "type": "query", "datasource": DATASOURCE,
            "query": variable.query, "definition": variable.query, "refresh": 2, "sort": 1,
            "includeAll": True, "allValue": ".*", "multi": True, "hide": 0, "regex": "", "options": [],
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "skipUrlSync": False}


def _layout(items: tuple[Panel | Row, ...]) -> list[dict]:
    panels: list[dict] = []
    x = y = 0
    for panel_id, item in enumerate(items, start=1):
        if isinstance(item, Row):
            y += PANEL_HEIGHT if x else 0
            panels.append({"id": panel_id, "type": "row", "title": item.title, "collapsed": False,
                           "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}, "panels": []})
            x, y = 0, y + 1
            continue
        if x + item.width > GRID_WIDTH:
            x, y = 0, y + PANEL_HEIGHT
        grid = {"h": PANEL_HEIGHT, "w": item.width, "x": x, "y": y}
        panels.append(_table(item, panel_id, grid) if item.matrix else _timeseries(item, panel_id, grid))
        x += item.width
    return panels


def _target(ref: int, query: Query, instant: bool) -> dict:
    target = {"refId": chr(ord("A") + ref), "datasource": DATASOURCE, "editorMode": "code",
              "expr": query.expr, "legendFormat": query.legend or "__auto", "range": not instant,
              "instant": instant}
    if instant:
        target["format"] = "table"
    return target


def _timeseries(panel: Panel, panel_id: int, grid: dict) -> dict:
    overrides = []
    if panel.right_axis:
        overrides.append({"matcher": {"id": "byRegexp", "options": panel.right_axis}, "properties": [
            {"id": "custom.axisPlacement", "value": "right"}, {"id": "unit", "value": panel.right_unit}]})
    if panel.dashed:
        overrides.append({"matcher": {"id": "byRegexp", "options": panel.dashed}, "properties": [
            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}]})
    return {
        "id": panel_id, "type": "timeseries", "title": panel.title, "description": panel.description,
        "datasource": DATASOURCE, "gridPos": grid,
        "fieldConfig": {"defaults": {"unit": panel.unit, "min": 0, "custom": {"fillOpacity": 10,
                                                                             "showPoints": "never"}},
                        "overrides": overrides},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [_target(i, q, instant=False) for i, q in enumerate(panel.queries)],
    }


def _table(panel: Panel, panel_id: int, grid: dict) -> dict:
    row_label, column_label = panel.matrix
    return {
        "id": panel_id, "type": "table", "title": panel.title, "description": panel.description,
        "datasource": DATASOURCE, "gridPos": grid,
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"showHeader": True, "sortBy": [{"displayName": f"{row_label}\\{column_label}",
                                                    "desc": False}]},
        "targets": [_target(i, q, instant=True) for i, q in enumerate(panel.queries)],
        "transformations": [
            {"id": "convertFieldType", "options": {"fields": {}, "conversions": [
                {"targetField": row_label, "destinationType": "number"}]}},
            {"id": "groupingToMatrix", "options": {"rowField": row_label, "columnField": column_label,
                                                   "valueField": "Value"}},
        ],
    }


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """Every (PromQL expression, legend format) a rendered dashboard runs, panels first,
    then the ``label_values(...)`` queries of its template variables (legend empty)."""
    found = [(t["expr"], t.get("legendFormat", "")) for p in dashboard["panels"] for t in p.get("targets", [])]
    found += [(v["query"], "") for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return found
