"""Building the proposer and the controller a config asks for."""

from __future__ import annotations

import torch

from cluster.config import ConfigError, TandemConfig, with_overrides
from cluster.kernels.packed_linear import pack_linears
from cluster.models.eagle3 import load_head
from cluster.models.layers.cpu_ops import attach_decode_ops
from cluster.models.shipped_heads import resolve_head
from cluster.runner.worker import Worker
from cluster.spec_decode.controller import AdaptiveController, FixedController, SpeculationController, TableController
from cluster.spec_decode.draft_proposer import DraftModelProposer, check_vocab_compatible
from cluster.spec_decode.eagle3_proposer import Eagle3Proposer
from cluster.spec_decode.latency_model import LatencyModel
from cluster.spec_decode.prior import PRIOR_ACCEPTANCE, PRIOR_WEIGHT, prior_model
from cluster.spec_decode.profile_data import load_profile_if_present
from cluster.spec_decode.proposer import NgramStepProposer, Proposer
from cluster.spec_decode.suffix import SuffixProposer


def build_speculation(config: TandemConfig, target_worker) -> tuple[Proposer | None, SpeculationController | None]:
    """(None, None) when speculation is off. A draft model is loaded with the target's
    block count and context length, and refused if its vocabulary differs."""
    spec = config.speculative
    if spec.method == "none":
        return None, None
    controller = build_controller(config)
    if spec.method == "ngram":
        return NgramStepProposer(spec.ngram_min, spec.ngram_max, spec.ngram_draft_per_match_token), controller
    if spec.method == "suffix":
        try:
            proposer = SuffixProposer(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                                      spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob,
                                      spec.suffix_warm_start_requests)
        except ImportError as exc:
            raise ConfigError(str(exc)) from exc
        return proposer, controller
    if spec.method == "eagle3":
        return build_eagle3(config, target_worker), controller

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


def build_eagle3(config: TandemConfig, target_worker) -> Eagle3Proposer:
    """The head of ``speculative.draft_model`` on the target's device and dtype, the target set to
    leave the head's aux states; raises ConfigError when the head does not fit the target."""
    if config.parallel.tensor_parallel_size > 1:
        raise ConfigError("speculative.method eagle3 runs with tensor_parallel_size 1 only")
    runner = target_worker.runner
    model = runner.model
    if not hasattr(model, "aux_layer_ids"):
        raise ConfigError(f"speculative.method eagle3 needs a Llama-family target; {config.model.model} is "
                          f"{type(model).__name__}")
    try:
        # Draft entries sit up to k - 2 positions past the context's end.
        head = load_head(resolve_head(config.speculative.draft_model), model.num_layers,
                         target_worker.max_model_len + config.speculative.num_speculative_tokens)
    except ValueError as exc:  # ModelLoadError included
        raise ConfigError(f"speculative.draft_model: {exc}") from exc
    hc = head.config
    if hc.vocab_size != model.vocab_size:
        raise ConfigError(f"the EAGLE-3 head was trained for a vocabulary of {hc.vocab_size} tokens, the target "
                          f"has {model.vocab_size}")
    if hc.target_hidden_size != model.config.hidden_size or max(hc.aux_layer_ids) >= model.num_layers:
        raise ConfigError(f"the EAGLE-3 head reads layers {list(hc.aux_layer_ids)} of width {hc.target_hidden_size}; "
                          f"the target has {model.num_layers} layers of width {model.config.hidden_size}")
    head = head.to(device=runner.device, dtype=runner.spec.dtype).eval()
    head.fuse_projections()
    pack_linears(head, runner.device, runner.spec.dtype)
    attach_decode_ops(head, runner.device, runner.spec.dtype)
    model.aux_layer_ids = hc.aux_layer_ids
    embed = head.embed_tokens if head.embed_tokens is not None else model.embed_tokens
    return Eagle3Proposer(head, embed, runner)


def lookahead_depth(config: TandemConfig, proposer, controller) -> int:
    """How many tokens to draft every step for an adaptive controller to learn acceptance past the
    k it verifies (:mod:`cluster.spec_decode.lookahead`): its largest k where the proposer drafts
    one-hot tokens without a model pass and ``speculative.learn_past_k`` is on, else 0."""
    if (not config.speculative.learn_past_k or not isinstance(controller, AdaptiveController)
            or not getattr(proposer, "free_lookahead", False)):
        return 0
    return controller.max_k


def profile_step_model(config: TandemConfig) -> tuple[LatencyModel | None, list[float] | None]:
    """The speculation profile's step-time model and coverage, whatever the controller
    ((None, None) without speculation or without a profile): what shapes the step-time curve
    a replica publishes for the router, so replicas that differ only in controller are
    routed alike."""
    profile = None if config.speculative.method == "none" else load_profile_if_present(config.speculative.profile)
    if profile is None:
        return None, None
    return profile.latency_model, profile.coverage


def device_type(config: TandemConfig) -> str:
    """cpu or cuda: the kind of device ``device.device`` names ("auto": cuda when there is one)."""
    name = config.device.device
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name.split(":")[0]


def build_controller(config: TandemConfig) -> SpeculationController:
    """The controller ``speculative.controller`` names. The table controller needs its profile;
    the adaptive one starts from its profile where there is one, else from the built-in prior
    (``prior.py``), and learns online either way."""
    spec = config.speculative
    if spec.controller == "fixed":
        return FixedController(spec.num_speculative_tokens)
    profile = load_profile_if_present(spec.profile)
    if profile is None:
        if spec.controller == "table":
            raise ConfigError("the 'table' controller needs speculative.profile (a `tandem profile` JSON that "
                              f"exists: {spec.profile!r} does not); the 'adaptive' one can start without")
        k = spec.num_speculative_tokens
        return AdaptiveController(prior_model(spec.method, device_type(config)), [PRIOR_ACCEPTANCE] * k, k,
                                  hysteresis=spec.hysteresis, explore_budget=spec.explore_budget,
                                  prior_weight=PRIOR_WEIGHT)
    max_k = min(spec.num_speculative_tokens, profile.max_k)
    if spec.controller == "table":
        return TableController({b: min(k, max_k) for b, k in profile.table.items()})
    return AdaptiveController.from_profile(profile, max_k, hysteresis=spec.hysteresis,
                                           explore_budget=spec.explore_budget)
