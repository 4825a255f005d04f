"""Tandem's three Grafana dashboards, as compact panel lists.

- ``tandem-overview``: the cluster as a client sees it: request rate, TTFT / TPOT / E2E
  latency quantiles, token throughput, errors.
- ``tandem-replicas``: per replica and per kind of GPU: batch, queue, KV cache,
  speculation (``k`` against batch size, the ``k`` table in force, acceptance), preemptions,
  prefix cache.
- ``tandem-router``: how the router spreads traffic over replica groups against the
  capacity each group offers.

Queries use the Prometheus names of ``catalog.METRICS`` (``vllm:`` and ``tandem:``, ``_total``
counters: what ``GET /metrics`` serves) and a few of Ray Serve's own (``SERVE_METRICS`` in
``dashboard_check``); a unit test parses every query and checks both the names and the labels. The committed
JSON under ``k8s/grafana/`` and the sidecar ConfigMap are this module's output:
regenerate them with ``tandem dashboards render``.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from cluster.metrics.grafana_model import DashboardSpec, Panel, Query, Row, Variable, build_dashboard

DASHBOARD_DIR = Path("k8s/grafana")
CONFIGMAP_PATH = Path("k8s/monitoring/grafana-dashboards-configmap.yaml")
CONFIGMAP_NAME = "tandem-grafana-dashboards"
SIDECAR_FOLDER = "Tandem"

RATE = "[$__rate_interval]"
QUANTILES = (0.5, 0.9, 0.99)
TOKENS_PER_S = "suffix: tok/s"


def _quantiles(title: str, description: str, histogram: str, selector: str, unit: str = "s") -> Panel:
    """p50/p90/p99 of a histogram, over every series the selector picks."""
    queries = tuple(
        Query(f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{selector}{RATE})))", f"p{q * 100:g}")
        for q in QUANTILES
    )
    return Panel(title, description, queries, unit=unit, width=8)


# ---- cluster overview --------------------------------------------------------------------

# Every query is scoped to one Ray cluster, namespace and Serve application (all by default), so
# two clusters side by side (an upgrade's old and new one, two namespaces) never mix. A series
# without one of these labels (a local `tandem serve`) still matches "All" (=~".*").
_SCOPE = 'ray_io_cluster=~"$cluster", namespace=~"$namespace", application=~"$application"'
_S = "{" + _SCOPE + "}"
_G = "{" + _SCOPE + ', group=~"$group"}'
_SCOPE_VARIABLES = (
    Variable("cluster", "Ray cluster", "label_values(vllm:num_requests_running, ray_io_cluster)"),
    Variable("namespace", "Namespace", 'label_values(vllm:num_requests_running{ray_io_cluster=~"$cluster"}, namespace)'),
    Variable("application", "Serve application",
             'label_values(vllm:num_requests_running{ray_io_cluster=~"$cluster", namespace=~"$namespace"}, application)'),
)
_GROUP = Variable("group", "Replica group", f"label_values(vllm:num_requests_running{_S}, group)")

OVERVIEW = DashboardSpec(
    uid="tandem-overview",
    title="Tandem / Cluster overview",
    description="Requests, latency, throughput and errors of the whole Tandem cluster.",
    variables=(*_SCOPE_VARIABLES, _GROUP),
    items=(
        Row("Requests"),
        Panel("Finished requests/s by finish reason",
              "Requests the replicas finished, by why they stopped (stop, length, abort).",
              (Query(f'sum by (finished_reason) (rate(vllm:request_success_total{_G}{RATE}))',
                     "{{finished_reason}}"),), unit="reqps"),
        Panel("HTTP requests/s by status code",
              "Every HTTP request Ray Serve's proxy answered, all routes.",
              (Query(f"sum by (status_code) (rate(ray_serve_num_http_requests_total{_S}{RATE}))",
                     "{{status_code}}"),), unit="reqps"),
        Row("Latency (measured in the replicas)"),
        _quantiles("Time to first token", "From arrival at the replica to the first output token.",
                   "vllm:time_to_first_token_seconds", _G),
        _quantiles("Time per output token",
                   "Inter-token latency: the gap between two outputs of a request, per token it carried.",
                   "vllm:inter_token_latency_seconds", _G),
        _quantiles("End-to-end request latency", "From arrival at the replica to the last token.",
                   "vllm:e2e_request_latency_seconds", _G),
        _quantiles("Queue time", "From arrival at the replica to the request's first scheduling.",
                   "vllm:request_queue_time_seconds", _G),
        _quantiles("HTTP latency at the proxy", "Ray Serve's proxy: whole request, all routes.",
                   "ray_serve_http_request_latency_ms", _S, unit="ms"),
        Row("Throughput"),
        Panel("Output tokens/s by group", "Tokens generated per second (accepted draft tokens included).",
              (Query(f"sum by (group) (rate(vllm:generation_tokens_total{_G}{RATE}))", "{{group}}"),
               Query(f"sum(rate(vllm:generation_tokens_total{_G}{RATE}))", "total")), unit=TOKENS_PER_S),
        Panel("Prompt tokens/s by group", "Prompt tokens of finished requests, per second.",
              (Query(f"sum by (group) (rate(vllm:prompt_tokens_total{_G}{RATE}))", "{{group}}"),
               Query(f"sum(rate(vllm:prompt_tokens_total{_G}{RATE}))", "total")), unit=TOKENS_PER_S),
        Row("Errors"),
        Panel("HTTP errors/s by code", "Responses with a 4xx or 5xx status, from Ray Serve's proxy.",
              (Query(f"sum by (error_code) (rate(ray_serve_num_http_error_requests_total{_S}{RATE}))",
                     "{{error_code}}"),), unit="reqps", width=8),
        Panel("Aborted requests/s by group", "Requests aborted while running (e.g. the client went away).",
              (Query(f'sum by (group) (rate(vllm:request_success_total{{finished_reason="abort", {_SCOPE}, group=~"$group"}}'
                     f"{RATE}))", "{{group}}"),), unit="reqps", width=8),
        Panel("Healthy replicas by deployment", "Replicas passing Ray Serve's health check.",
              (Query(f"sum by (deployment) (ray_serve_deployment_replica_healthy{_S})", "{{deployment}}"),),
              width=8),
    ),
)

# ---- per replica and per GPU kind --------------------------------------------------------

_R = "{" + _SCOPE + ', group=~"$group", device_kind=~"$device_kind", replica=~"$replica"}'


def _by_replica(title: str, description: str, expr: str, unit: str = "short") -> Panel:
    return Panel(title, description, (Query(expr, "{{group}} {{replica}}"),), unit=unit)


def _ratio(numerator: str, denominator: str, by: str) -> str:
    return (f"sum by ({by}) (rate({numerator}{_R}{RATE}))"
            f" / sum by ({by}) (rate({denominator}{_R}{RATE}))")


REPLICAS = DashboardSpec(
    uid="tandem-replicas",
    title="Tandem / Replicas and GPU kinds",
    description="Each replica's batch, queue, KV cache, speculation and prefix cache; aggregates per GPU kind.",
    variables=(
        *_SCOPE_VARIABLES,
        _GROUP,
        Variable("device_kind", "GPU kind", f"label_values(vllm:num_requests_running{_G}, device_kind)"),
        Variable("replica", "Replica",
                 "label_values(vllm:num_requests_running{" + _SCOPE + ', group=~"$group", device_kind=~"$device_kind"}, '
                 "replica)"),
    ),
    items=(
        Row("Load"),
        _by_replica("Batch size (running requests)", "Requests in the running batch.",
                    f"sum by (group, replica) (vllm:num_requests_running{_R})"),
        _by_replica("Waiting requests", "Requests admitted to the replica but not yet scheduled.",
                    f"sum by (group, replica) (vllm:num_requests_waiting{_R})"),
        _by_replica("KV cache usage", "Fraction of KV cache blocks held by requests (1 = full).",
                    f"max by (group, replica) (vllm:kv_cache_usage_perc{_R})", unit="percentunit"),
        _by_replica("Preemptions/s", "Requests preempted (to be recomputed) for lack of KV blocks.",
                    f"sum by (group, replica) (rate(vllm:num_preemptions_total{_R}{RATE}))", unit="ops"),
        _by_replica("LoRA adapters loaded", "Adapters loaded in the engine (lora_modules and those loaded on "
                    "demand from lora_dir, at most max_loras).",
                    f"max by (group, replica) (tandem:lora_adapters_loaded{_R})"),
        _by_replica("Requests waiting for an adapter", "Requests whose adapter waits for room: every one of "
                    "max_loras held by requests in the engine.",
                    f"sum by (group, replica) (tandem:lora_requests_waiting{_R})"),
        Row("Speculation"),
        Panel("Speculation length k against batch size",
              "Lines: the k the controller chose for the latest step (left axis). Dashed, right axis: "
              "the running batch size it chose it for.",
              (Query(f"max by (group, replica) (tandem:spec_k{_R})", "k {{group}} {{replica}}"),
               Query(f"sum by (group, replica) (vllm:num_requests_running{_R})", "batch {{group}} {{replica}}")),
              right_axis="^batch ", right_unit="short", dashed="^batch "),
        Panel("k table in force (rows: batch size, columns: replica)",
              "The controller's chosen k for each batch size, as last re-fitted from live timings and acceptance.",
              (Query(f"max by (batch_size, replica) (tandem:spec_k_table{_R})"),),
              matrix=("batch_size", "replica")),
        _by_replica("Draft acceptance rate", "Accepted draft tokens / proposed draft tokens.",
                    _ratio("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
                           "group, replica"), unit="percentunit"),
        Panel("Acceptance estimate per draft position",
              "The controller's P(draft at position i accepted | earlier ones accepted), mean over replicas.",
              (Query(f"avg by (group, position) (tandem:spec_acceptance_estimate{_R})",
                     "{{group}} position {{position}}"),), unit="percentunit"),
        Panel("Engine steps/s by k", "Engine steps by the speculation length they ran with.",
              (Query(f"sum by (k) (rate(tandem:spec_steps_total{_R}{RATE}))", "k={{k}}"),), unit="ops"),
        _by_replica("Prefix cache hit rate", "Prompt tokens found in the prefix cache / prompt tokens looked up.",
                    _ratio("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "group, replica"),
                    unit="percentunit"),
        Row("Per GPU kind"),
        Panel("Output tokens/s by GPU kind", "Tokens generated per second, summed over the kind's replicas.",
              (Query(f"sum by (device_kind) (rate(vllm:generation_tokens_total{_R}{RATE}))", "{{device_kind}}"),),
              unit=TOKENS_PER_S, width=8),
        Panel("Mean batch size by GPU kind", "Running requests per replica, averaged over the kind's replicas.",
              (Query(f"avg by (device_kind) (vllm:num_requests_running{_R})", "{{device_kind}}"),), width=8),
        Panel("Acceptance rate by GPU kind", "Accepted / proposed draft tokens over the kind's replicas.",
              (Query(_ratio("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
                            "device_kind"), "{{device_kind}}"),), unit="percentunit", width=8),
    ),
)

# ---- the router ----------------------------------------------------------------------------

_DECISIONS = f"rate(tandem:router_decisions_total{_G}{RATE})"
_CAPACITY = f"tandem:capacity_tokens_per_second{_G}"
_TRAFFIC_SHARE = f"sum by (group) ({_DECISIONS}) / ignoring (group) group_left sum({_DECISIONS})"
_CAPACITY_SHARE = f"sum by (group) ({_CAPACITY}) / ignoring (group) group_left sum({_CAPACITY})"

ROUTER = DashboardSpec(
    uid="tandem-router",
    title="Tandem / Router",
    description="Share of traffic the router sends each replica group against the group's share of capacity.",
    variables=(*_SCOPE_VARIABLES, _GROUP),
    items=(
        Panel("Traffic share against capacity share by group",
              "Solid: the group's share of routing decisions. Dashed: its share of predicted peak output "
              "tokens/s (from each replica's profile, current k and acceptance). A router that follows "
              "capacity keeps each pair together under load.",
              (Query(_TRAFFIC_SHARE, "traffic {{group}}"), Query(_CAPACITY_SHARE, "capacity {{group}}")),
              unit="percentunit", width=24, dashed="^capacity "),
        Panel("Traffic share / capacity share by group",
              "1 = the group gets traffic in proportion to its capacity; above 1 it is favoured.",
              (Query(f"({_TRAFFIC_SHARE}) / ({_CAPACITY_SHARE})", "{{group}}"),)),
        Panel("Routing decisions/s by group", "Requests the ingress sent to each replica group.",
              (Query(f"sum by (group) ({_DECISIONS})", "{{group}}"),), unit="reqps"),
        Panel("Retries/s by failed group",
              "Requests a replica of the group failed before their first token (its engine or process gone, "
              "or the group left with no running replica) that the ingress sent once more, elsewhere.",
              (Query(f"sum by (group) (rate(tandem:router_retries_total{_G}{RATE}))", "{{group}}"),), unit="reqps"),
        Panel("Output tokens/s against capacity by group",
              "Solid: tokens generated per second. Dashed: the group's predicted peak.",
              (Query(f"sum by (group) (rate(vllm:generation_tokens_total{_G}{RATE}))", "output {{group}}"),
               Query(f"sum by (group) ({_CAPACITY})", "capacity {{group}}")),
              unit=TOKENS_PER_S, dashed="^capacity "),
        Panel("Running and waiting requests by group", "The load the router sees, summed over each group.",
              (Query(f"sum by (group) (vllm:num_requests_running{_G})", "running {{group}}"),
               Query(f"sum by (group) (vllm:num_requests_waiting{_G})", "waiting {{group}}")),
              dashed="^waiting "),
        Panel("Capacity per replica", "Each replica's predicted peak output tokens/s.",
              (Query(f"sum by (group, device_kind, replica) ({_CAPACITY})",
                     "{{group}} {{device_kind}} {{replica}}"),), unit=TOKENS_PER_S, width=24),
    ),
)

DASHBOARDS: tuple[DashboardSpec, ...] = (OVERVIEW, REPLICAS, ROUTER)


def dashboards() -> dict[str, dict]:
    """File name -> Grafana JSON model of every Tandem dashboard."""
    return {f"{spec.uid}.json": build_dashboard(spec) for spec in DASHBOARDS}


def dashboard_json(dashboard: dict) -> str:
    """The text a dashboard is committed and shipped as (stable: indented, key order kept)."""
    return json.dumps(dashboard, indent=2) + "\n"


class _LiteralDumper(yaml.SafeDumper):
    """Writes multi-line strings as ``|`` blocks, so the ConfigMap's JSON stays readable."""


_LiteralDumper.add_representer(
    str, lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text,
                                                      style="|" if "\n" in text else None))


def configmap_yaml() -> str:
    """A ConfigMap that Grafana's dashboard sidecar picks up (label ``grafana_dashboard: "1"``),
    one data key per dashboard file; ``grafana_folder`` names the folder for sidecars set
    to read it (``sidecar.dashboards.folderAnnotation`` in Grafana's Helm chart)."""
    manifest = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": CONFIGMAP_NAME,
            "labels": {"grafana_dashboard": "1", "app.kubernetes.io/part-of": "tandem"},
            "annotations": {"grafana_folder": SIDECAR_FOLDER},
        },
        "data": {name: dashboard_json(d) for name, d in dashboards().items()},
    }
    header = "# Generated by `tandem dashboards render` from cluster/metrics/dashboards.py: do not edit.\n"
    return header + yaml.dump(manifest, Dumper=_LiteralDumper, sort_keys=False, width=200)


def render(out_dir: Path = DASHBOARD_DIR, configmap: Path | None = CONFIGMAP_PATH) -> list[Path]:
    """Write every dashboard's JSON into ``out_dir`` (and the ConfigMap, unless None)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, dashboard in dashboards().items():
        path = out_dir / name
        path.write_text(dashboard_json(dashboard))
        written.append(path)
    if configmap is not None:
        configmap.parent.mkdir(parents=True, exist_ok=True)
        configmap.write_text(configmap_yaml())
        written.append(configmap)
    return written
