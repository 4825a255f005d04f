"""Every metric Tandem exports, with its kind, unit, labels and meaning.

Engine figures use vLLM's names where the meaning is the same (vLLM's ``vllm:``
namespace dropped: Ray no longer allows ``:`` in metric names); Tandem's own carry a
``tandem_`` prefix. Ray's Prometheus endpoint adds ``ray_`` in front of every name,
``_total`` after a counter's, and ``_bucket``/``_sum``/``_count`` after a
histogram's. Every series also carries Ray Serve's ``deployment``, ``replica`` and
``application`` labels and the ``COMMON_LABELS`` below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PROMETHEUS_PREFIX = "ray_"
COMMON_LABELS = ("group", "device_kind")  # the replica group and its kind of device

# Latency buckets in seconds, as vLLM's; ITL also below 10 ms, where a step's time is
# divided among the several tokens speculation accepts.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as recorded; Prometheus shows it as ``prometheus_names`` says
    kind: Literal["counter", "gauge", "histogram"]
    unit: str
    description: str
    labels: tuple[str, ...] = ()  # besides Serve's and COMMON_LABELS
    buckets: tuple[float, ...] = ()
    source: Literal["replica", "ingress"] = "replica"

    @property
    def all_labels(self) -> tuple[str, ...]:
        """Labels besides Ray Serve's own: a replica's metric also carries COMMON_LABELS."""
        return (*COMMON_LABELS, *self.labels) if self.source == "replica" else self.labels

    @property
    def prometheus_name(self) -> str:
        """The series name a PromQL query uses (a histogram's base name)."""
        suffix = "_total" if self.kind == "counter" else ""
        return f"{PROMETHEUS_PREFIX}{self.name}{suffix}"

    @property
    def prometheus_names(self) -> tuple[str, ...]:
        """Every series name Prometheus holds for this metric."""
        if self.kind == "histogram":
            base = self.prometheus_name
            return (f"{base}_bucket", f"{base}_sum", f"{base}_count")
        return (self.prometheus_name,)


def _c(name, unit, description, labels=(), source="replica"):
    return MetricSpec(name, "counter", unit, description, tuple(labels), source=source)


def _g(name, unit, description, labels=()):
    return MetricSpec(name, "gauge", unit, description, tuple(labels))


def _h(name, description, buckets):
    return MetricSpec(name, "histogram", "seconds", description, buckets=buckets)


METRICS: tuple[MetricSpec, ...] = (
    # ---- the engine, under vLLM's names ------------------------------------------------
    _g("num_requests_running", "requests", "requests in the running batch"),
    _g("num_requests_waiting", "requests", "requests waiting to be scheduled"),
    _g("kv_cache_usage_perc", "fraction", "fraction of KV cache blocks held by requests (1 = full)"),
    _c("prefix_cache_queries", "tokens", "prompt tokens looked up in the prefix cache"),
    _c("prefix_cache_hits", "tokens", "prompt tokens found in the prefix cache"),
    _c("num_preemptions", "preemptions", "requests preempted (recomputed later) for lack of KV blocks"),
    _c("prompt_tokens", "tokens", "prompt tokens, counted when a request's prompt is computed (its first token)"),
    _c("generation_tokens", "tokens", "tokens generated"),
    _c("request_success", "requests", "finished requests by finish reason (stop, length, abort)",
       labels=("finished_reason",)),
    _h("time_to_first_token_seconds", "time from arrival at the replica to the first output token",
       _TTFT_BUCKETS),
    _h("inter_token_latency_seconds", "time between two consecutive outputs of a request, per token",
       _ITL_BUCKETS),
    _h("e2e_request_latency_seconds", "time from arrival at the replica to the last token",
       _REQUEST_BUCKETS),
    _h("request_queue_time_seconds", "time a request waited before it was first scheduled",
       _REQUEST_BUCKETS),
    _c("spec_decode_num_drafts", "drafts", "request-steps that verified at least one draft token"),
    _c("spec_decode_num_draft_tokens", "tokens", "draft tokens proposed and verified"),
    _c("spec_decode_num_accepted_tokens", "tokens", "draft tokens accepted"),
    _c("spec_decode_num_accepted_tokens_per_pos", "tokens", "draft tokens accepted at each draft position",
       labels=("position",)),
    # ---- Tandem's own --------------------------------------------------------------------
    _g("tandem_spec_k", "tokens", "speculation length k the controller chose for the latest step"),
    _g("tandem_spec_k_table", "tokens", "the controller's k per batch size in force (the table)",
       labels=("batch_size",)),
    _g("tandem_spec_acceptance_estimate", "probability",
       "the controller's estimate of P(draft at a position accepted, given the earlier ones were), "
       "over the positions asked for (one not proposed counts as rejected)",
       labels=("position",)),
    _c("tandem_spec_steps", "steps", "engine steps by the k they ran with", labels=("k",)),
    _g("tandem_capacity_tokens_per_second", "tokens/s",
       "predicted peak output-token throughput: max over batch sizes of b * E(k) / step time, from the "
       "replica's step-time curve (profile corrected by live timings), current k and acceptance"),
    _g("tandem_lora_adapters_loaded", "adapters", "LoRA adapters loaded in the engine (lora_modules and those "
       "loaded on demand from lora_dir; native engine, when it serves adapters)"),
    _g("tandem_lora_requests_waiting", "requests", "requests waiting for their adapter: its folder being read, "
       "or every one of max_loras held (also counted in num_requests_waiting)"),
    _c("tandem_lora_adapter_loads", "adapters", "adapters loaded on demand from lora_dir"),
    _c("tandem_router_decisions", "requests", "requests the ingress sent to each replica group",
       labels=("group",), source="ingress"),
)

METRICS_BY_NAME = {m.name: m for m in METRICS}


def exported_series_names() -> set[str]:
    """Every Prometheus series name Tandem exports (for checking dashboard queries)."""
    return {name for m in METRICS for name in m.prometheus_names}


def markdown_table() -> str:
    """The catalog as a Markdown table, for docs/metrics.md."""
    rows = ["| Prometheus name | kind | unit | labels | meaning |", "|---|---|---|---|---|"]
    for m in METRICS:
        labels = ", ".join(m.all_labels)
        rows.append(f"| `{m.prometheus_name}` | {m.kind} | {m.unit} | {labels} | {m.description} |")
    return "\n".join(rows)
