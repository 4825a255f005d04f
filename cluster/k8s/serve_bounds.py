"""What Ray Serve updates in place: each deployment's replica bounds and autoscaling.

Ray Serve hashes an application's ``args`` into its code version, so any edit of the Tandem
config inlined there (``args: {config: ...}``) restarts every replica, GPU ones included. The
render therefore keeps the bounds out of ``args`` and writes them in the Serve config's
``deployments:`` section, whose ``num_replicas`` and ``autoscaling_config`` Serve applies to
the running replicas without restarting them (``serve deploy``, or a RayService update).
What stays in ``args`` in their place is what the application's code reads of them: whether a
group keeps replicas (its readiness counts it) or may scale to zero, as a marker that changes
only when a group crosses zero.
"""

from __future__ import annotations

import copy

from cluster.config_serve import (CAPACITY_POLICY, INGRESS_DEPLOYMENT, AutoscalingConfig, ServeConfig,
                                  replica_deployment_name)

_AUTOSCALING_FIELDS = ("min_replicas", "max_replicas", "initial_replicas", "target_ongoing_requests",
                       "upscale_delay_s", "downscale_delay_s")


def split_bounds(serve: ServeConfig, embedded: dict) -> tuple[dict, list[dict]]:
    """(the inline config without the bounds, the ``deployments:`` entries that carry them)."""
    args = copy.deepcopy(embedded)
    settings = args.setdefault("serve", {})
    entries = []
    for group, raw in zip(serve.groups, settings.get("groups", [])):
        raw.pop("num_replicas", None)
        entry = {"name": replica_deployment_name(group.name)}
        if group.autoscaling is not None:
            raw["autoscaling"] = _marker(group.autoscaling)
            entry["autoscaling_config"] = _autoscaling(group.autoscaling)
        else:
            entry["num_replicas"] = group.num_replicas
        entries.append(entry)
    entry = {"name": INGRESS_DEPLOYMENT}
    if serve.ingress_autoscaling is not None:
        settings["ingress_autoscaling"] = _marker(serve.ingress_autoscaling)
        entry["autoscaling_config"] = _autoscaling(serve.ingress_autoscaling)
    else:
        settings.pop("ingress_num_replicas", None)
        entry["num_replicas"] = serve.ingress_num_replicas or 1
    entries.append(entry)
    return args, entries


def _marker(scaling: AutoscalingConfig) -> dict:
    """What the code reads of an autoscaled deployment's bounds: whether it may scale to zero."""
    return {"min_replicas": min(scaling.min_replicas, 1), "max_replicas": 1}


def _autoscaling(scaling: AutoscalingConfig) -> dict:
    values = scaling.model_dump()
    config = {key: values[key] for key in _AUTOSCALING_FIELDS if values[key] is not None}
    if scaling.policy == "capacity":
        config["policy"] = {"policy_function": CAPACITY_POLICY, "policy_kwargs": {"target_load": scaling.target_load}}
    return config
