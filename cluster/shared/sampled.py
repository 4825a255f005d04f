"""What one step produced for a request, as the runner hands it to the scheduler and the outputs
(plain lists: no tensors here)."""

from __future__ import annotations

from typing import NamedTuple

# per position: (token ids, logprobs, rank of the first token), the position's token first then the top-n
PositionLogprobs = tuple[list[int], list[float], int]


class SampledTokens(NamedTuple):
    """A request's new tokens from one step: accepted drafts, then one sampled token."""

    token_ids: list[int]
    # per token: (token ids, logprobs, rank of the sampled token), sampled first then the top-n
    logprobs: list[PositionLogprobs] | None
    num_accepted: int  # draft tokens accepted (0 without speculation); the one count of them


class PromptLogprobs(NamedTuple):
    """Logprobs of a run of a request's prompt tokens, computed by one step."""

    first_position: int  # the prompt position of the first entry's token (>= 1)
    entries: list[PositionLogprobs]
