"""Which requests may be given draft tokens: the speculation policy's rule, which the scheduler
asks while it reserves room (no torch here: the scheduler imports it)."""

from __future__ import annotations

from cluster.shared.request import Request


def may_draft(request: Request) -> bool:
    """Whether a decoding request may verify drafts this step. Those with penalties or a pending
    ``min_tokens`` decode without: their sampling state changes token by token; so do those with a
    ``logit_bias``, ``allowed_token_ids`` or ``bad_words``, which the proposers do not apply.
    ``logprobs`` do not stop drafting: verification returns them for every emitted token."""
    params = request.sampling_params
    return not (params.needs_penalties or params.logit_bias or params.bad_words
                or params.allowed_token_ids is not None or request.num_output_tokens < params.min_tokens)
