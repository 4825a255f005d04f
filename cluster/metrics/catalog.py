"""Every metric Tandem exports, with its kind, unit, labels and meaning.

Engine figures carry vLLM's names, types, buckets and ``model_name`` label
(``vllm:num_requests_running``, ``vllm:time_to_first_token_seconds``, ...), so the
dashboards, alerts and autoscalers written for vLLM's ``/metrics`` read Tandem's unchanged;
Tandem's own figures (the speculation controller, capacity, LoRA, the router) carry
``tandem:``. Every process that records them (engine replicas, ingresses) keeps them in a
Prometheus registry of its own (``prometheus_sink.py``); the ingress serves all of them
merged at ``GET /metrics`` on the API port (``exposition.py``), each series with the
``application``, ``deployment`` and ``replica`` it came from (``SOURCE_LABELS``) beside
its own labels. A counter shows with ``_total`` after its name, a histogram as
``_bucket``/``_sum``/``_count``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Every replica series: the served model (vLLM's label), the replica group and its kind of device.
COMMON_LABELS = ("model_name", "group", "device_kind")
# Added to every series when the ingress merges the processes' registries.
SOURCE_LABELS = ("application", "deployment", "replica")


def _one_two_five(top: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``top``: vLLM's buckets for token counts."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > top:
                return tuple(float(b) for b in out)
            out.append(m * scale)
        scale *= 10


# vLLM's bucket bounds (vllm/v1/metrics/buckets.py), so histogram_quantile reads the same.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = _one_two_five(1_000_000)  # request lengths; vLLM stops at max_model_len, here one scale fits all
_ITERATION_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
_PREEMPTION_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as recorded; Prometheus shows it as ``prometheus_names`` says
    kind: Literal["counter", "gauge", "histogram"]
    unit: str
    description: str
    labels: tuple[str, ...] = ()  # besides Serve's and COMMON_LABELS
    buckets: tuple[float, ...] = ()
    source: Literal["replica", "ingress"] = "replica"
    latest_only: bool = False  # a gauge whose labels change: only the latest label set is kept

    @property
    def all_labels(self) -> tuple[str, ...]:
        """The labels the recording process gives it: a replica's also carry COMMON_LABELS."""
        return (*COMMON_LABELS, *self.labels) if self.source == "replica" else self.labels

    @property
    def exposed_name(self) -> str:
        """The metric's name at ``/metrics``: ``vllm:...`` for vLLM's figures, ``tandem:...`` for Tandem's."""
        return f"tandem:{self.name.removeprefix('tandem_')}" if self.name.startswith("tandem_") else f"vllm:{self.name}"

    @property
    def prometheus_name(self) -> str:
        """The series name a PromQL query uses (a histogram's base name)."""
        suffix = "_total" if self.kind == "counter" else ""
        return f"{self.exposed_name}{suffix}"

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


def _h(name, description, buckets, unit="seconds"):
    return MetricSpec(name, "histogram", unit, description, buckets=buckets)


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
    _h("request_time_per_output_token_seconds", "per finished request: (last token - first token) / "
       "(output tokens - 1)", _ITL_BUCKETS),
    _h("request_inference_time_seconds", "per finished request: from its first scheduling to its last token",
       _REQUEST_BUCKETS),
    _h("request_prefill_time_seconds", "per finished request: from its first scheduling to its first token",
       _REQUEST_BUCKETS),
    _h("request_decode_time_seconds", "per finished request: from its first token to its last", _REQUEST_BUCKETS),
    _h("request_prompt_tokens", "per finished request: its prompt tokens", _TOKEN_BUCKETS, unit="tokens"),
    _h("request_generation_tokens", "per finished request: its output tokens", _TOKEN_BUCKETS, unit="tokens"),
    _h("request_max_num_generation_tokens", "per finished request: the most output tokens it could have had "
       "(max_tokens, or the room left in the context)", _TOKEN_BUCKETS, unit="tokens"),
    _h("request_params_max_tokens", "per finished request: its max_tokens", _TOKEN_BUCKETS, unit="tokens"),
    _h("request_params_n", "per finished request: its n (each choice is one engine request: 1)", _N_BUCKETS,
       unit="choices"),
    _h("request_num_preemptions", "per finished request: the times it was preempted", _PREEMPTION_BUCKETS,
       unit="preemptions"),
    _h("iteration_tokens_total", "per engine step: the tokens it computed (prompt and output)", _ITERATION_BUCKETS,
       unit="tokens"),
    # Names an older vLLM exported, still read by vLLM's example dashboard: the same figures again.
    _g("gpu_cache_usage_perc", "fraction", "kv_cache_usage_perc under vLLM's earlier name"),
    _h("time_per_output_token_seconds", "inter_token_latency_seconds under vLLM's earlier name", _ITL_BUCKETS),
    MetricSpec("lora_requests_info", "gauge", "seconds", "with LoRA: the time of the latest step, labelled with the "
               "adapters of running and of waiting requests (comma-separated) and max_loras",
               ("max_lora", "waiting_lora_adapters", "running_lora_adapters"), latest_only=True),
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
    _g("tandem_suffix_tree_requests", "requests", "suffix decoding: responses in the replica-wide suffix tree "
       "(finished ones kept up to suffix_decoding_max_cached_requests, and the in-flight ones)"),
    _g("tandem_suffix_tree_tokens", "tokens", "suffix decoding: tokens of the responses in the replica-wide tree"),
    _g("tandem_suffix_tree_prompts", "requests", "suffix decoding: prompt trees alive (one per active request)"),
    _c("tandem_suffix_tree_evictions", "requests", "suffix decoding: responses evicted from the replica-wide tree, "
       "oldest first"),
    _c("tandem_suffix_speculations", "speculations", "suffix decoding: speculations asked for, by the length of "
       "the context they matched (a range of tokens; 0: none)", labels=("match_len",)),
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
    _c("tandem_router_retries", "requests", "requests a replica of the group failed before their first token "
       "(its engine or process gone) that the ingress sent once more, to another replica or group",
       labels=("group",), source="ingress"),
)

METRICS_BY_NAME = {m.name: m for m in METRICS}

# Recorded once, exported under both names: metric -> its older vLLM name.
ALIASES = {"kv_cache_usage_perc": "gpu_cache_usage_perc",
           "inter_token_latency_seconds": "time_per_output_token_seconds"}


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
