"""Settings of a simulation run (``tandem sim CONFIG``), as strict pydantic models.

A YAML file under ``configs/sim/`` loads into :class:`SimConfig`. Unknown keys and values
of the wrong type raise :class:`cluster.config.ConfigError` naming the key, as for the
engine's own settings. Paths (profiles, the device table) are read beside the YAML file.

A *group* is a set of identical replicas on one kind of device. Its step times come
either from a measured ``tandem profile`` JSON (``profile``) or, for a GPU kind, are
derived from the device table's published figures (``device``); the report says which.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.config import ConfigError, path_beside, format_errors, read_yaml_mapping
from cluster.config_serve import AutoscalingConfig

ROUTERS = ("tandem", "pow2", "round-robin", "prefix-affinity")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelFigures(_Strict):
    """What the roofline needs of a model (the target or its draft)."""

    name: str
    num_params_b: float = Field(gt=0, description="parameters, billions")
    bytes_per_param: float = Field(2.0, gt=0, description="2 for bf16 weights")
    kv_bytes_per_token: int = Field(gt=0, description="K and V of all layers for one token, bytes")


class GroupConfig(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,40}$")
    device: str = Field(description="a key of the device table (H100, A10G, ...) or a label such as cpu")
    profile: str | None = Field(None, description="measured `tandem profile` JSON: the true step times")
    controller_profile: str | None = Field(
        None, description="the profile the replica's controller and router start from (default: profile, "
        "or the derived model)")
    num_replicas: int = Field(1, ge=1, description="fixed size when autoscaling is unset")
    autoscaling: AutoscalingConfig | None = None
    max_num_seqs: int = Field(64, ge=1)
    kv_capacity_tokens: int | None = Field(None, ge=1, description="default: derived from device memory")
    step_time_scale: float = Field(1.0, ge=1.0, description="stretch every step (bench router's slow group)")
    step_noise: float = Field(0.0, ge=0, lt=1, description="relative std of a lognormal factor on each step")
    acceptance: list[float] | None = Field(
        None, description="true per-position acceptance on this workload (default: the profile's, or the top level)")
    price_per_hour: float | None = Field(None, ge=0, description="$ per replica-hour; default: the device table")


class PhaseConfig(_Strict):
    duration_s: float = Field(gt=0)
    load: float | None = Field(None, ge=0, description="fraction of the cluster's capacity")
    rate: float | None = Field(None, ge=0, description="requests/s")

    @model_validator(mode="after")
    def _check(self) -> "PhaseConfig":
        if (self.load is None) == (self.rate is None):
            raise ValueError("a phase needs exactly one of load and rate")
        return self


class WorkloadConfig(_Strict):
    dataset: Literal["random", "shared-prefix", "instructions"] = "random"
    num_requests: int = Field(1000, ge=1, description="ignored with phases (they set the count)")
    input_len: int = Field(256, ge=1, description="random: prompt tokens")
    output_len: int = Field(128, ge=1)
    range_ratio: float = Field(0.0, ge=0, lt=1)
    num_prefixes: int = Field(8, ge=1, description="shared-prefix: system prompts")
    prefix_len: int = Field(512, ge=1, description="shared-prefix: words of each system prompt")
    question_len: int = Field(32, ge=1)
    rate: float | None = Field(None, gt=0, description="requests/s")
    load: float | None = Field(None, gt=0, description="fraction of the cluster's capacity (instead of rate)")
    burstiness: float = Field(1.0, gt=0, description="gamma shape of the gaps; 1 = Poisson")
    phases: list[PhaseConfig] | None = None

    @model_validator(mode="after")
    def _check(self) -> "WorkloadConfig":
        if self.phases is None and (self.rate is None) == (self.load is None):
            raise ValueError("workload needs exactly one of rate and load (or phases)")
        return self


class SloConfig(_Strict):
    ttft_s: float = Field(2.0, gt=0)
    tpot_s: float = Field(0.1, gt=0)


class SchedulingConfig(_Strict):
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_k: int = Field(6, ge=0, le=16, description="largest k of the table and adaptive controllers")
    routing_stats_period_s: float = Field(0.5, gt=0)
    routing_staleness_s: float = Field(5.0, gt=0)
    router_candidates: int = Field(32, ge=2, description="replicas a router looks at per request (sampled)")
    prefix_affinity_blocks: int = Field(8, ge=0)
    block_size: int = Field(16, ge=1)
    autoscale_period_s: float = Field(1.0, gt=0)
    replica_startup_s: float = Field(30.0, ge=0, description="from the scale-up decision to serving")


class SimConfig(_Strict):
    name: str = "sim"
    seed: int = 0
    devices: str = Field("devices.yaml", description="the device table, beside this file")
    target: ModelFigures | None = Field(None, description="needed by groups with derived step times")
    draft: ModelFigures | None = Field(None, description="the draft model (none: n-gram drafting, free)")
    acceptance: list[float] | None = Field(None, description="per-position acceptance for derived groups")
    mean_context_len: int = Field(1024, ge=1, description="derived step times: context attended per request")
    groups: list[GroupConfig] = Field(min_length=1)
    workload: WorkloadConfig
    routers: list[Literal["tandem", "pow2", "round-robin", "prefix-affinity"]] = Field(
        default_factory=lambda: list(ROUTERS), min_length=1)
    controllers: list[str] = Field(default_factory=lambda: ["adaptive"], min_length=1,
                                   description="adaptive, table, fixed:K")
    baseline_router: str = "tandem"
    baseline_controller: str = "adaptive"
    slo: SloConfig = SloConfig()
    scheduling: SchedulingConfig = SchedulingConfig()

    @field_validator("controllers")
    @classmethod
    def _check_controllers(cls, value: list[str]) -> list[str]:
        for name in value:
            parse_controller(name)
        return value

    @field_validator("acceptance")
    @classmethod
    def _check_acceptance(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and (not value or not all(0 <= a <= 1 for a in value)):
            raise ValueError("acceptance must be a non-empty list of rates in [0, 1]")
        return value

    @model_validator(mode="after")
    def _check(self) -> "SimConfig":
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"groups names must be unique, got {names}")
        parse_controller(self.baseline_controller)
        if self.baseline_router not in ROUTERS:
            raise ValueError(f"baseline_router must be one of {', '.join(ROUTERS)}, got {self.baseline_router!r}")
        derived = [g.name for g in self.groups if g.profile is None]
        if derived and (self.target is None or self.acceptance is None):
            raise ValueError(f"groups {derived} have no profile: their step times are derived, which needs "
                             "target (model figures) and acceptance")
        return self


def parse_controller(name: str) -> tuple[str, int | None]:
    """``"adaptive"`` -> ("adaptive", None); ``"fixed:3"`` -> ("fixed", 3). ValueError otherwise."""
    policy, _, k = name.partition(":")
    if policy in ("adaptive", "table") and not k:
        return policy, None
    if policy == "fixed" and k.isdigit() and int(k) <= 16:
        return policy, int(k)
    raise ValueError(f"controller {name!r}: expected adaptive, table or fixed:K with 0 <= K <= 16")


def sim_config_from_dict(data: dict, source: str = "sim config") -> SimConfig:
    try:
        return SimConfig.model_validate(data or {})
    except ValidationError as err:
        raise ConfigError(format_errors(err, source)) from None


def load_sim_config(path: str | Path) -> SimConfig:
    """The config at ``path`` with its relative paths resolved beside it."""
    path = Path(path)
    data = read_yaml_mapping(path, "sim config")
    config = sim_config_from_dict(data, str(path))
    config.devices = path_beside(path, config.devices)
    for group in config.groups:
        group.profile = path_beside(path, group.profile)
        group.controller_profile = path_beside(path, group.controller_profile)
    return config
