"""Building the proposer and the controller a config asks for."""

from __future__ import annotations

from cluster.config import TandemConfig, with_overrides
from cluster.spec.controller import FixedController, SpeculationController
from cluster.spec.proposer import NgramStepProposer, Proposer


def build_speculation(config: TandemConfig, target_worker) -> tuple[Proposer | None, SpeculationController | None]:
    """(None, None) when speculation is off. A draft model is loaded with the target's
    block count and context length, and refused if its vocabulary differs."""
    spec = config.speculative
    if spec.method == "none":
        return None, None
    controller = FixedController(spec.num_speculative_tokens)
    if spec.method == "ngram":
        return NgramStepProposer(spec.ngram_min, spec.ngram_max), controller

    from cluster.runner.worker import Worker
    from cluster.spec.draft_proposer import DraftModelProposer, check_vocab_compatible

    draft_config = with_overrides(
        config,
        model=spec.draft_model,
        dtype=spec.draft_dtype or config.model.dtype,
        max_model_len=target_worker.max_model_len,
        num_blocks=target_worker.runner.num_blocks,
    )
    draft = Worker.from_config(draft_config)
    check_vocab_compatible(target_worker.tokenizer, draft.tokenizer, target_worker.vocab_size, draft.vocab_size)
    return DraftModelProposer(draft.runner, target_worker.runner), controller
