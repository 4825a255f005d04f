"""Building the proposer and the controller a config asks for."""

from __future__ import annotations

from cluster.config import ConfigError, TandemConfig, with_overrides
from cluster.runner.worker import Worker
from cluster.spec_decode.controller import AdaptiveController, FixedController, SpeculationController, TableController
from cluster.spec_decode.draft_proposer import DraftModelProposer, check_vocab_compatible
from cluster.spec_decode.latency_model import LatencyModel
from cluster.spec_decode.profile_data import SpeculationProfile
from cluster.spec_decode.proposer import NgramStepProposer, Proposer


def build_speculation(config: TandemConfig, target_worker) -> tuple[Proposer | None, SpeculationController | None]:
    """(None, None) when speculation is off. A draft model is loaded with the target's
    block count and context length, and refused if its vocabulary differs."""
    spec = config.speculative
    if spec.method == "none":
        return None, None
    controller = build_controller(config)
    if spec.method == "ngram":
        return NgramStepProposer(spec.ngram_min, spec.ngram_max, spec.ngram_draft_per_match_token), controller

    draft_config = with_overrides(
        config,
        model=spec.draft_model,
        dtype=spec.draft_dtype or config.model.dtype,
        quantization=spec.draft_quantization or config.model.quantization,
        max_model_len=target_worker.max_model_len,
        num_blocks=target_worker.runner.num_blocks,
        tensor_parallel_size=1,  # the draft runs whole on the driver rank
        batch_invariant=False,  # the draft only proposes: its rounding never reaches the output
        lora_modules={},  # adapters are the target's: the draft proposes for every request without one
    )
    draft = Worker.from_config(draft_config)
    check_vocab_compatible(target_worker.tokenizer, draft.tokenizer, target_worker.vocab_size, draft.vocab_size)
    return DraftModelProposer(draft.runner, target_worker.runner), controller


def profile_step_model(config: TandemConfig) -> tuple[LatencyModel | None, list[float] | None]:
    """The speculation profile's step-time model and coverage, whatever the controller
    ((None, None) without speculation or without a profile): what shapes the step-time curve
    a replica publishes for the router, so replicas that differ only in controller are
    routed alike."""
    if config.speculative.method == "none" or not config.speculative.profile:
        return None, None
    profile = SpeculationProfile.load(config.speculative.profile)
    return profile.latency_model, profile.coverage


def build_controller(config: TandemConfig) -> SpeculationController:
    spec = config.speculative
    if spec.controller == "fixed":
        return FixedController(spec.num_speculative_tokens)
    if not spec.profile:
        raise ConfigError(f"the {spec.controller!r} controller needs speculative.profile "
                          "(or run a replica group that has its own profile)")
    profile = SpeculationProfile.load(spec.profile)
    max_k = min(spec.num_speculative_tokens, profile.max_k)
    if spec.controller == "table":
        return TableController({b: min(k, max_k) for b, k in profile.table.items()})
    return AdaptiveController.from_profile(profile, max_k, hysteresis=spec.hysteresis,
                                           explore_budget=spec.explore_budget)
