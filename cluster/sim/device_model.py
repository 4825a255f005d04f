"""Step times of a simulated replica: measured (a ``tandem profile``) or derived (roofline).

A step runs ``num_decode`` decoding requests with ``k`` draft tokens each, plus prefill
chunks of ``num_prefill_tokens`` tokens from ``num_prefill_requests`` requests. Its time
extends the profile's linear model (:mod:`cluster.spec_decode.latency_model`) to prefill
tokens, which cost what verified tokens cost (the same matrix products)::

    T = c0 + c1 (b + p) + c2 (b (1 + D(k)) + P) + k (d0 + d1 b)      (k = 0 when b = 0)

with b = num_decode, p = num_prefill_requests, P = num_prefill_tokens and D(k) the draft
tokens a request carries into the verifying pass: k for a draft model, the sum of the
profile's first k coverages for n-gram lookup (which often proposes fewer than asked;
:func:`cluster.spec_decode.latency_model.expected_drafted`), in expectation.

Derived models, for GPU kinds nobody measured here (labelled ``derived`` everywhere), with
the device table's efficiency shares (a device's own where its entry gives them):

    c0 = target weight bytes / (bandwidth * eff_bw) + step_overhead_s
    c1 = kv_bytes_per_token * mean_context_len / (bandwidth * eff_bw)   (attention reads)
    c2 = 2 * target params / (bf16 FLOPs * eff_compute)                 (per token)
    d0, d1 likewise for the draft model (zero for n-gram drafting)

A sum of the memory and compute terms, where a roofline takes their maximum: it errs
high by at most 2x where both are equal, and is exact at either end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.config import ConfigError, format_errors
from cluster.sim.config import GroupConfig, ModelFigures, SimConfig
from cluster.spec_decode.latency_model import LatencyModel, expected_drafted, expected_tokens
from cluster.spec_decode.profile_data import SpeculationProfile


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Efficiency(_Strict):
    bandwidth: float = Field(0.8, gt=0, le=1)
    compute: float = Field(0.5, gt=0, le=1)
    step_overhead_s: float = Field(0.003, ge=0)
    memory_utilization: float = Field(0.9, gt=0, le=1)


class DeviceFigures(_Strict):
    memory_bandwidth_gb_s: float = Field(gt=0)
    bf16_tflops: float = Field(gt=0)
    memory_gb: float = Field(gt=0)
    price_per_hour: float = Field(ge=0, description="assumed list price, US$")
    source: str
    efficiency: Efficiency | None = Field(
        None, description="this device's own shares and overhead, where the table's do not hold (figures "
        "measured as rates the device reaches rather than a datasheet's peaks)")


class DeviceTable(_Strict):
    efficiency: Efficiency = Efficiency()
    devices: dict[str, DeviceFigures]

    @classmethod
    def load(cls, path: str | Path) -> "DeviceTable":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"device table {path} does not exist")
        try:
            return cls.model_validate(yaml.safe_load(path.read_text()))
        except ValidationError as err:
            raise ConfigError(format_errors(err, str(path))) from None


@dataclass(frozen=True)
class StepModel:
    """True step times of one replica group, and where they come from."""

    latency: LatencyModel
    acceptance: tuple[float, ...]  # per draft position asked for, given the previous accepted (effective)
    kv_capacity_tokens: int
    source: str  # "measured: <profile>" or "derived: <device source>"
    price_per_hour: float
    max_k: int
    coverage: tuple[float, ...] | None = None  # per position asked for, the share proposed (None: all)

    @property
    def derived(self) -> bool:
        return self.source.startswith("derived")

    @property
    def prefill_seconds_per_token(self) -> float:
        return self.latency.target_coef[2]

    def __post_init__(self) -> None:
        # D(k) for every k a step can ask for, once: step_seconds reads it on every simulated step.
        coverage = None if self.coverage is None else list(self.coverage)
        drafted = tuple(expected_drafted(coverage, k) for k in range(max(self.max_k, 16) + 1))
        object.__setattr__(self, "_drafted", drafted)

    def drafted_per_request(self, k: int) -> float:
        """D(k): draft tokens a decoding request carries into the verifying pass, in expectation."""
        return self._drafted[k]

    def step_seconds(self, num_decode: int, k: int, num_prefill_tokens: int, num_prefill_requests: int) -> float:
        c0, c1, c2 = self.latency.target_coef
        if num_decode == 0:
            k = 0
        drafted = self.drafted_per_request(k) if k else 0.0
        seconds = (c0 + c1 * (num_decode + num_prefill_requests)
                   + c2 * (num_decode * (1 + drafted) + num_prefill_tokens))
        if k:
            d0, d1 = self.latency.draft_coef
            seconds += k * (d0 + d1 * num_decode)
        return seconds


def derive_latency_model(device: DeviceFigures, eff: Efficiency, target: ModelFigures, draft: ModelFigures | None,
                         mean_context_len: int) -> LatencyModel:
    """The roofline step model of the module docstring."""
    bandwidth = device.memory_bandwidth_gb_s * 1e9 * eff.bandwidth
    flops = device.bf16_tflops * 1e12 * eff.compute

    def coefficients(model: ModelFigures) -> tuple[float, float, float]:
        weights = model.num_params_b * 1e9 * model.bytes_per_param / bandwidth
        attention = model.kv_bytes_per_token * mean_context_len / bandwidth
        per_token = 2 * model.num_params_b * 1e9 / flops
        return weights, attention, per_token

    w, a, t = coefficients(target)
    draft_coef = [0.0, 0.0]
    if draft is not None:
        dw, da, dt = coefficients(draft)
        draft_coef = [dw + eff.step_overhead_s / 2, da + dt]
    return LatencyModel([w + eff.step_overhead_s, a, t], draft_coef)


def derived_kv_capacity(device: DeviceFigures, eff: Efficiency, target: ModelFigures, draft: ModelFigures | None) -> int:
    """Tokens of KV cache that fit beside the weights (the draft's KV is held too)."""
    weights = target.num_params_b * 1e9 * target.bytes_per_param
    per_token = target.kv_bytes_per_token
    if draft is not None:
        weights += draft.num_params_b * 1e9 * draft.bytes_per_param
        per_token += draft.kv_bytes_per_token
    free = device.memory_gb * 1e9 * eff.memory_utilization - weights
    if free <= 0:
        raise ConfigError(f"the model does not fit in {device.memory_gb:g} GB: weights take {weights / 1e9:.1f} GB")
    return int(free // per_token)


def group_step_model(config: SimConfig, group: GroupConfig, table: DeviceTable) -> StepModel:
    """The true step model of ``group``: its profile when it has one, else derived."""
    figures = table.devices.get(group.device)
    price = group.price_per_hour if group.price_per_hour is not None else (figures.price_per_hour if figures else 0.0)
    max_k = config.scheduling.max_k
    if group.profile is not None:
        profile = SpeculationProfile.load(group.profile)
        capacity = group.kv_capacity_tokens or group.max_num_seqs * 4096
        acceptance = group.acceptance if group.acceptance is not None else profile.acceptance
        coverage = tuple(profile.coverage) if profile.coverage is not None else None
        return StepModel(profile.latency_model, tuple(acceptance), capacity,
                         f"measured: {Path(group.profile).name}", price, max_k, coverage)
    if figures is None:
        raise ConfigError(f"groups[{group.name}].device: {group.device!r} is not in the device table "
                          f"({', '.join(table.devices)}) and the group has no profile")
    efficiency = figures.efficiency or table.efficiency
    model = derive_latency_model(figures, efficiency, config.target, config.draft, config.mean_context_len)
    capacity = group.kv_capacity_tokens or derived_kv_capacity(figures, efficiency, config.target, config.draft)
    acceptance = group.acceptance if group.acceptance is not None else config.acceptance
    return StepModel(model, tuple(acceptance), capacity, f"derived: {figures.source}", price, max_k)


def controller_prior(group: GroupConfig, truth: StepModel) -> tuple[LatencyModel, list[float], list[float] | None]:
    """What a replica's controller and router start from (step model, acceptance, coverage):
    ``controller_profile`` when set (a profile measured elsewhere, as the real replicas may
    be given), else the truth."""
    if group.controller_profile is None:
        return truth.latency, list(truth.acceptance), None if truth.coverage is None else list(truth.coverage)
    profile = SpeculationProfile.load(group.controller_profile)
    return profile.latency_model, list(profile.acceptance), profile.coverage


def peak_requests_per_s(model: StepModel, max_num_seqs: int, mean_prompt: float, mean_output: float,
                        step_time_scale: float = 1.0) -> float:
    """Requests/s one replica sustains at its best fixed k: a full batch (as far as the KV
    cache holds requests halfway through their output) decoding, plus each request's
    prefill. What a workload's ``load`` is a fraction of."""
    per_request_kv = mean_prompt + mean_output / 2
    batch = max(1, min(max_num_seqs, int(model.kv_capacity_tokens // max(per_request_kv, 1.0))))
    c0, c1, c2 = model.latency.target_coef
    prefill = c1 + c2 * mean_prompt
    best = 0.0
    for k in range(model.max_k + 1):
        tokens = expected_tokens(list(model.acceptance), k)
        decode = mean_output * model.step_seconds(batch, k, 0, 0) / (batch * tokens)
        best = max(best, 1.0 / ((decode + prefill) * step_time_scale))
    return best
