"""Settings of the serving cluster: the HTTP front, the router, and replica groups.

A *replica group* is a set of identical replicas on one kind of device (one Ray Serve
deployment each): its resources, autoscaling, speculation profile and engine overrides.
A cluster on mixed GPUs has one group per GPU kind. A group's ``engine`` overrides may
pick the engine backend: ``engine: vllm`` (short for ``engine: {backend: vllm}``), or
``engine: {backend: vllm, max_num_seqs: 32}`` beside other overrides.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def replica_deployment_name(group: str) -> str:
    """The Ray Serve deployment of a replica group's replicas."""
    return f"replica-{group}"


INGRESS_DEPLOYMENT = "ingress"
CAPACITY_POLICY = "deployments.autoscaling_policy:CapacityPolicy"  # Tandem's autoscaling policy, for Ray Serve


class AutoscalingConfig(_Strict):
    """Ray Serve's autoscaling_config for one group."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(8.0, gt=0, description="per replica")
    # Ray Serve's defaults: a GPU replica takes minutes to start (a node, the image, the weights), so one
    # given back after a minute's lull would be paid for again at the next burst.
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    policy: Literal["ongoing_requests", "capacity"] = Field(
        "ongoing_requests", description="ongoing_requests: Ray Serve's own (target_ongoing_requests per replica); "
        "capacity: Tandem's, each replica's requests over the batch size where its predicted throughput levels "
        "off, kept near target_load (an engine group's replicas only)")
    target_load: float = Field(0.8, gt=0, le=1, description="capacity policy: the load to keep each replica at")

    @model_validator(mode="after")
    def _check(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.min_replicas must be <= autoscaling.max_replicas")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("autoscaling.initial_replicas must lie in [min_replicas, max_replicas]")
        return self


class ReplicaGroupConfig(_Strict):
    name: str = Field("default", pattern=r"^[a-z0-9][a-z0-9-]{0,40}$")
    device_kind: str = Field("cpu", description="label published for routing and metrics, e.g. H100")
    accelerator_type: str | None = Field(None, description="Ray's accelerator_type, e.g. H100 or A10G")
    num_replicas: int = Field(1, ge=1, description="fixed size when autoscaling is unset")
    autoscaling: AutoscalingConfig | None = None
    num_cpus: float = Field(1.0, ge=0, description="per replica (per rank with tensor parallelism)")
    num_gpus: float = Field(0.0, ge=0, description="per rank")
    tensor_parallel_size: int = Field(1, ge=1)
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    profile: str | None = Field(None, description="this device's `tandem profile` JSON (overrides speculative.profile)")
    engine: dict[str, Any] = Field(
        default_factory=dict, description="engine settings for this group, flat: {max_num_seqs: 32, dtype: float16}; "
        "`backend: vllm` in it picks vLLM for this group, and `engine: vllm` (or native) alone is short for that"
    )
    step_time_scale: float = Field(
        1.0, ge=1.0, description="emulate a slower device by stretching every engine step; tests and demos only"
    )
    max_ongoing_requests: int = Field(256, ge=1, description="Ray Serve's cap of requests in one replica")

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_shorthand(cls, value):
        """``engine: vllm`` is ``engine: {backend: vllm}``."""
        if isinstance(value, str):
            if value not in ("native", "vllm"):
                raise ValueError(f"engine: a backend name must be native or vllm, got {value!r} "
                                 "(or give a mapping of engine settings, e.g. {backend: vllm, max_num_seqs: 32})")
            return {"backend": value}
        return value


class ServeConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    served_model_name: str | None = Field(None, description="the id in /v1/models; defaults to model.model")
    api_key: str | list[str] | None = Field(
        None, description="when set, requests (/v1 and /debug) need 'Authorization: Bearer <key>' with one of these")
    api_key_env: str | None = Field(
        None, description="name of an environment variable holding the API key (several: comma-separated)")
    api_key_file: str | None = Field(
        None, description="a file of API keys (comma- or line-separated), read again when it changes: rotation "
        "without a restart (`tandem k8s render` mounts the api_key_secret there in place of api_key_env)")
    router: Literal["tandem", "pow2"] = Field(
        "tandem", description="tandem: predicted completion time; pow2: Ray Serve's power of two choices"
    )
    routing_stats_period_s: float = Field(0.5, gt=0)
    log_format: Literal["text", "json"] = Field(
        "text", description="json: Ray Serve's logs (its access line per request, with the request's id) and the "
        "engine cores' as JSON lines; `tandem k8s render` sets json unless the file says")
    log_requests: bool = Field(False, description="a log line per request's start and end in the engine core, "
                               "naming its id (vLLM's --enable-log-requests)")
    drain_timeout_s: float = Field(
        30.0, ge=0, description="on SIGTERM (and when Serve stops a replica): the seconds requests in flight get to "
        "finish while new ones are turned away with a 503; what is left is then aborted. On Kubernetes the pods' "
        "terminationGracePeriodSeconds is this plus 30")
    per_request_spec_decode_metrics: Literal["none", "summary"] = Field(
        "none", description="summary: every completion and chat completion carries its speculative decoding (drafts "
        "proposed and accepted, steps, mean acceptance length) in vLLM's top-level `metrics.speculative_decoding`, "
        "streamed in the last chunk with the usage (vLLM's --per-request-spec-decode-metrics; a request asks for it "
        "alone with return_spec_decode_metrics)")
    routing_staleness_s: float = Field(5.0, gt=0, description="older replica stats make the router fall back")
    prefix_affinity_blocks: int = Field(8, ge=0, description="leading blocks of a prompt used for cache affinity")
    max_queued_requests: int = Field(
        -1, ge=-1, description="Ray Serve's per-caller queue cap before 503 (-1: unlimited)"
    )
    ingress_num_cpus: float = Field(0.5, ge=0)
    ingress_max_replicas_per_node: int | None = Field(
        None, ge=1, description="Ray Serve's max_replicas_per_node for the ingress; `tandem k8s render` sets 1, so "
        "the ingress replicas sit on different nodes (the head among them) and draining one keeps the API up")
    ingress_num_replicas: int | None = Field(
        None, ge=1, description="ingress replicas when ingress_autoscaling is unset; default 1 with `tandem serve`, "
        "2 on Kubernetes (`tandem k8s render` sets it, and refuses fewer: a drained node must not take the API down)")
    ingress_autoscaling: AutoscalingConfig | None = Field(
        None, description="Ray Serve's autoscaling of the ingress (target_ongoing_requests per ingress replica)")
    direct_ingress: bool = Field(
        True, description="`tandem serve`: the ingress replica answers HTTP on `port` itself (Ray Serve's direct "
        "ingress, throughput-optimized mode) instead of behind Serve's HTTP proxy, one Ray hop less per token; "
        "the proxy then listens on `proxy_port`")
    proxy_port: int | None = Field(
        None, ge=1, le=65535, description="Serve's HTTP proxy port under direct ingress (default: port + 1)")
    metrics_export_port: int = Field(
        8080, ge=1, le=65535,
        description="Ray's Prometheus endpoint (/metrics) on the node `tandem serve` starts; a cluster sets it with "
        "`ray start --metrics-export-port`",
    )
    ingress_max_ongoing_requests: int = Field(
        4096, ge=1, description="requests one ingress replica handles at once (Ray Serve's default of 5 "
        "would queue the rest in the proxy, in front of the engines' batching)"
    )
    responses_store_size: int = Field(
        1000, ge=0, description="Responses API responses kept for previous_response_id and GET /v1/responses/{id}, "
        "in one store for the cluster; past it the least recently used is dropped (0: none kept, `store` is ignored)")
    groups: list[ReplicaGroupConfig] = Field(default_factory=lambda: [ReplicaGroupConfig()], min_length=1)

    @model_validator(mode="after")
    def _check(self) -> "ServeConfig":
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"serve.groups names must be unique, got {names}")
        return self

    def logging_config(self) -> dict:
        """Ray Serve's logging_config of the application: an access line per request (route, status,
        latency, request id) and, with ``log_format: json``, JSON lines."""
        return {"encoding": "JSON" if self.log_format == "json" else "TEXT", "enable_access_log": True}

