"""From one parsed OpenAI request to the engine requests of each choice, one per replica group.

Everything a request needs is settled here, once, at the ingress: its ``max_tokens``
(OpenAI's defaults: 16 on ``/v1/completions``; on chat, the room left in the group's
context) and what the routers rank it by (:class:`RoutingRequest`: the prompt's leading
block hashes as that group's engines name them, and the output length the cost model
assumes). Groups may differ in context length, block size and hash seed, so each choice
gets one ``GenerateRequest`` per group it may go to; the router picks one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.hosting.protocol import GenerateRequest
from cluster.errors import ParamError
from cluster.routing.prefix_hashes import leading_block_hashes
from cluster.routing.stats import RoutingRequest
from cluster.structured.constraint import StructuredOutputs

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default on /v1/completions
# What the router's cost model assumes a chat request without max_tokens generates: its bound
# (the whole context left) would make every such request look like thousands of decode steps.
ROUTING_DEFAULT_OUTPUT_TOKENS = 256


@dataclass(frozen=True)
class GroupShape:
    """What the ingress knows of a replica group's engines to build requests for them."""

    block_size: int
    hash_seed: int  # the engines' prefix-cache hash seed (``engine_hash_seed``)
    max_model_len: int


def resolved_max_tokens(requested: int | None, chat: bool, num_prompt_tokens: int, max_model_len: int) -> int:
    """The request's ``max_tokens``: the caller's, else 16 for completions and, for chat, the
    room left in the context (at least 1: a prompt too long is the engine's error to report)."""
    if requested is not None:
        return requested
    if not chat:
        return COMPLETION_DEFAULT_MAX_TOKENS
    return max(1, max_model_len - num_prompt_tokens)


def truncated_prompt(prompt_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt as vLLM's ``truncate_prompt_tokens`` asks: its last ``keep`` tokens (-1: as many
    as the context holds, ``max_model_len``; None: all of it). Raises ParamError for 0 or more
    than the context."""
    if keep is None:
        return prompt_ids
    if keep == -1:
        keep = max_model_len
    if not 1 <= keep <= max_model_len:
        raise ParamError("truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] "
                                                   f"(this model's maximum context length), got {keep}")
    return prompt_ids[-keep:]


def choice_requests(body, chat: bool, request_id: str, prompt_ids: list[int], choice: int,
                    shapes: dict[str, GroupShape], prefix_blocks: int, num_logprobs: int | None,
                    constraint: StructuredOutputs | None = None,
                    lora: str | None = None) -> dict[str, GenerateRequest]:
    """One choice's ``GenerateRequest`` per group of ``shapes`` that can hold it (``choice``
    offsets the seed): the prompt and a given ``max_tokens`` fit the group's context. A prompt
    that fits no group goes to every group, whose engine refuses it with its own message.
    ``lora``: the adapter it runs with (``shapes`` holds only groups that serve it).

    Raises ValueError (a ParamError) naming the offending field: from SamplingParams, or
    ``max_tokens`` when the prompt fits a context but the prompt and ``max_tokens`` fit none,
    in the words vLLM's server uses, which clients parse to retry with less."""
    requested = body.requested_max_tokens()
    room = {group: shape.max_model_len - len(prompt_ids) for group, shape in shapes.items()}
    fitting = [g for g in shapes if room[g] >= 1 and (requested is None or requested <= room[g])]
    if not fitting and any(r >= 1 for r in room.values()):
        widest = max(shapes, key=lambda g: shapes[g].max_model_len)
        field = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
        raise ParamError(field, f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's "
                                f"maximum context length is {shapes[widest].max_model_len} tokens and your request "
                                f"has {len(prompt_ids)} input tokens ({requested} > "
                                f"{shapes[widest].max_model_len} - {len(prompt_ids)})")
    requests = {}
    for group in fitting or shapes:
        shape = shapes[group]
        max_tokens = resolved_max_tokens(requested, chat, len(prompt_ids), shape.max_model_len)
        params = body.sampling_params(max_tokens, num_logprobs, choice, constraint)
        expected = ROUTING_DEFAULT_OUTPUT_TOKENS if requested is None and chat else max_tokens
        hashes = leading_block_hashes(prompt_ids, shape.block_size, shape.hash_seed, prefix_blocks, body.cache_salt,
                                      lora)
        routing = RoutingRequest(len(prompt_ids), min(expected, max_tokens), hashes, lora)
        requests[group] = GenerateRequest(request_id, prompt_ids, params, body.cache_salt, routing, lora)
    return requests
