"""vLLM's request outputs as Tandem's deltas (``GenerateDelta``), logprobs included."""

from __future__ import annotations

from cluster.hosting.protocol import GenerateDelta
from cluster.shared.outputs import Logprob


def output_delta(out, num_output_before: int) -> GenerateDelta:
    """One of vLLM's delta ``RequestOutput`` s; ``num_output_before``: the tokens sent before it."""
    completion = out.outputs[0]
    token_ids = list(completion.token_ids)
    logprobs = None
    if completion.logprobs is not None:
        logprobs = [_position_logprobs(position) for position in completion.logprobs]
    prompt_logprobs = None
    if out.prompt_logprobs:  # vLLM's delta outputs after the first carry an empty list
        prompt_logprobs = [None if position is None else _position_logprobs(position)
                           for position in out.prompt_logprobs]
    return GenerateDelta(
        text=completion.text,
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        num_prompt_tokens=len(out.prompt_token_ids or ()),
        num_output_tokens=num_output_before + len(token_ids),
        num_cached_tokens=int(out.num_cached_tokens or 0),
        prompt_logprobs=prompt_logprobs,
    )


def _position_logprobs(position) -> dict[int, Logprob]:
    return {int(t): Logprob(float(lp.logprob), int(lp.rank) if lp.rank is not None else 0, lp.decoded_token)
            for t, lp in position.items()}
