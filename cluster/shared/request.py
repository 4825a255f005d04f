"""A request's state as the scheduler and the engine see it (no tensors here)."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from cluster.shared.outputs import SpecDecodeCounts
from cluster.shared.sampling_params import SamplingParams

if TYPE_CHECKING:  # the matcher fills token bitmasks (torch); the scheduler and KV manager only hold it
    from cluster.structured.matcher import GrammarMatcher


def cache_extra_keys(cache_salt: str | None, lora_name: str | None) -> tuple:
    """What besides its tokens names a request's blocks in the prefix cache (``Request.extra_keys``;
    the routers hash prompts with the same)."""
    return ((cache_salt,) if cache_salt else ()) + ((("lora", lora_name),) if lora_name else ())


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_DEAD_END = "grammar_dead_end"  # the output's grammar reached a state no token leaves

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_DEAD_END,
        )


class Request:
    """One sequence being generated.

    Invariants: ``num_computed_tokens <= num_tokens``; tokens at positions
    ``< num_computed_tokens`` have K/V in the request's blocks. A preempted request
    has ``num_computed_tokens == 0`` and recomputes prompt and outputs as one prefill.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        prompt: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.waiting_steps = 0  # steps spent waiting, for waiting_served_ratio
        # Prefix cache: names of the request's full blocks, computed lazily, and what
        # besides the tokens changes their KV (a salt keeps tenants' caches apart, an
        # adapter computes other K/V from the same tokens).
        self.cache_salt = cache_salt
        self.lora_name = lora_name  # the LoRA adapter it runs with (None: the base model)
        self.extra_keys: tuple = cache_extra_keys(cache_salt, lora_name)
        self.block_hashes: list = []
        # Speculative decoding: tokens whose K/V the draft model holds (never more than
        # the target's verified ``num_computed_tokens``; 0 again after preemption).
        self.draft_num_computed_tokens = 0
        # Its drafts proposed, verified and accepted so far (the engine adds each step's).
        self.spec_decode = SpecDecodeCounts()
        # bad_words as token sequences (set by the engine, which has the tokenizer).
        self.bad_words_token_ids: list[list[int]] = []
        # Structured outputs: the grammar state after the output tokens (None: unconstrained).
        self.grammar: GrammarMatcher | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def is_stop_token(self, token: int) -> bool:
        """Whether ``token`` ends the request once ``min_tokens`` are out: EOS (unless
        ``ignore_eos``) or one of ``stop_token_ids``."""
        params = self.sampling_params
        return (token == self.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids

    def bad_word_bans(self) -> list[int]:
        """The tokens that would complete a bad word now: the last of each sequence whose other
        tokens end the output so far (a one-token word is always banned)."""
        out = self.output_token_ids
        bans = []
        for ids in self.bad_words_token_ids:
            prefix = len(ids) - 1
            if prefix == 0 or (prefix <= len(out) and out[-prefix:] == ids[:-1]):
                bans.append(ids[-1])
        return bans

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past ``num_output_tokens`` (a stop string ended the output)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[len(self.all_token_ids) - drop :]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
