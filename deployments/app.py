"""Build the Serve application from a validated config.

One deployment per replica group (``replica-<group>``, with the group's resources,
autoscaling and router) behind one ``ingress`` deployment, beside the ``responses-store``
(one replica, no CPU reserved) unless ``serve.responses_store_size`` is 0. Works with
``tandem serve CONFIG``, and with ``serve run deployments.app:app_builder
config=configs/local.yaml`` / ``serve deploy`` (import path plus args). A KubeRay
RayService passes the config inline: ``args: {config: {model: ..., serve: ...}}``.
"""

from __future__ import annotations

from pathlib import Path

from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig as RayAutoscalingConfig
from ray.serve.config import AutoscalingPolicy
from ray.serve.config import RequestRouterConfig

from cluster.config import ConfigError, TandemConfig, config_from_dict, load_config
from cluster.config_serve import CAPACITY_POLICY, INGRESS_DEPLOYMENT, ReplicaGroupConfig, replica_deployment_name
from cluster.planning.memory_plan import check_memory
from deployments.ingress import OpenAIIngress
from deployments.response_store import DEPLOYMENT_NAME as STORE_DEPLOYMENT
from deployments.response_store import ResponseStoreReplica
from deployments.replica import TandemReplica
from deployments.router import TandemRequestRouter


def build_app(config: TandemConfig | dict | str | Path) -> Application:
    """The application of ``config``: a TandemConfig, a config mapping, or a YAML file's path."""
    if isinstance(config, dict):
        config = config_from_dict(config, "args.config")
    elif isinstance(config, (str, Path)):
        config = load_config(config)
    elif not isinstance(config, TandemConfig):
        raise ConfigError(f"the config must be a YAML file's path or a mapping of sections, "
                          f"got {type(config).__name__}")
    check_memory(config)  # refuse a group that cannot fit its device before Ray places it
    data = config.model_dump()
    replicas = {}
    for group in config.serve.groups:
        engine_tp = config.parallel.tensor_parallel_size
        if engine_tp > 1 and engine_tp != group.tensor_parallel_size:
            raise ConfigError(
                f"parallel.tensor_parallel_size is {engine_tp} but serve.groups[{group.name}].tensor_parallel_size "
                f"is {group.tensor_parallel_size}: a served group's replicas are split as its "
                "serve.groups[].tensor_parallel_size says (it sizes the placement group); set it there"
            )
        deployment = serve.deployment(TandemReplica).options(
            name=replica_deployment_name(group.name), **replica_options(config, group)
        )
        replicas[group.name] = deployment.bind(data, group.name)
    ingress = OpenAIIngress.options(**ingress_options(config))
    store = None
    if config.serve.responses_store_size > 0:
        store = serve.deployment(ResponseStoreReplica).options(
            name=STORE_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
            max_ongoing_requests=config.serve.ingress_max_ongoing_requests,
        ).bind(config.serve.responses_store_size)
    return ingress.bind(data, replicas, store)


def ingress_options(config: TandemConfig) -> dict:
    """Serve deployment options of the ingress (resources, scaling, placement, shutdown)."""
    serve_config = config.serve
    options = {"name": INGRESS_DEPLOYMENT, "ray_actor_options": {"num_cpus": serve_config.ingress_num_cpus},
               "max_ongoing_requests": serve_config.ingress_max_ongoing_requests,
               "graceful_shutdown_timeout_s": serve_config.drain_timeout_s, **ingress_scaling(config)}
    if serve_config.ingress_max_replicas_per_node:
        options["max_replicas_per_node"] = serve_config.ingress_max_replicas_per_node
    return options


def ingress_scaling(config: TandemConfig) -> dict:
    """The ingress's replica count or autoscaling (``serve.ingress_num_replicas`` / ``ingress_autoscaling``)."""
    if config.serve.ingress_autoscaling is not None:
        return {"autoscaling_config": _autoscaling(config.serve.ingress_autoscaling)}
    return {"num_replicas": config.serve.ingress_num_replicas or 1}


def _autoscaling(a) -> RayAutoscalingConfig:
    policy = {}
    if a.policy == "capacity":
        policy["policy"] = AutoscalingPolicy(policy_function=CAPACITY_POLICY,
                                             policy_kwargs={"target_load": a.target_load})
    return RayAutoscalingConfig(
        min_replicas=a.min_replicas, max_replicas=a.max_replicas, initial_replicas=a.initial_replicas,
        target_ongoing_requests=a.target_ongoing_requests, upscale_delay_s=a.upscale_delay_s,
        downscale_delay_s=a.downscale_delay_s, **policy,
    )


def replica_options(config: TandemConfig, group: ReplicaGroupConfig) -> dict:
    """Serve deployment options of one group (resources, scaling, router)."""
    actor = {"num_cpus": group.num_cpus, "num_gpus": group.num_gpus}
    if group.accelerator_type:
        actor["accelerator_type"] = group.accelerator_type
    options: dict = {
        "ray_actor_options": actor,
        "max_ongoing_requests": group.max_ongoing_requests,
        "max_queued_requests": config.serve.max_queued_requests,
        "graceful_shutdown_timeout_s": config.serve.drain_timeout_s,
        "health_check_period_s": 5,
    }
    if group.tensor_parallel_size > 1:
        bundle = {"CPU": group.num_cpus, "GPU": group.num_gpus}
        options["placement_group_bundles"] = [bundle] * group.tensor_parallel_size
        options["placement_group_strategy"] = group.placement_strategy
    if group.autoscaling is not None:
        options["autoscaling_config"] = _autoscaling(group.autoscaling)
    else:
        options["num_replicas"] = group.num_replicas
    if config.serve.router == "tandem":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=TandemRequestRouter,
            request_router_kwargs={"staleness_seconds": config.serve.routing_staleness_s},
            request_routing_stats_period_s=config.serve.routing_stats_period_s,
        )
    return options


def app_builder(args: dict) -> Application:
    """For ``serve run deployments.app:app_builder config=PATH`` and Serve configs whose
    ``args`` hold ``config``: a YAML file's path, or the config itself as a mapping."""
    if "config" not in args:
        raise ConfigError("pass the config: serve run deployments.app:app_builder config=configs/local.yaml, "
                          "or args: {config: {...}} in a Serve config")
    return build_app(args["config"])
