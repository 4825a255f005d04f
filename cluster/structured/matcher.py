"""One request's grammar state, advanced by its output tokens.

``GrammarMatcher`` wraps llguidance's ``LLMatcher``. Its state always stands after the
request's last output token (``num_consumed`` of them); masks for speculative positions
are computed by consuming the draft tokens and rolling back, so the state never moves on a
token that was not accepted.
"""

from __future__ import annotations

import torch
from llguidance import LLMatcher, LLTokenizer

from cluster.structured.constraint import ConstraintError, StructuredOutputs


def bitmask_words(vocab_size: int) -> int:
    """Width of a token bitmask row: one bit per token id, 32 per int32 word."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    def __init__(self, tokenizer: LLTokenizer, constraint: StructuredOutputs) -> None:
        self._matcher = LLMatcher(tokenizer, constraint.grammar_text(), log_level=0)
        if self._matcher.is_error():
            raise ConstraintError(constraint.param, f"{constraint.param}: {self._matcher.get_error()}")
        self.num_consumed = 0  # output tokens the state stands after

    @property
    def is_dead(self) -> bool:
        """The grammar reached a state no token can leave (an error inside llguidance)."""
        return self._matcher.is_error()

    @property
    def is_stopped(self) -> bool:
        """The output is complete: the grammar allows nothing more (or only the end of text)."""
        return self._matcher.is_stopped()

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` (in order, from the current state) the grammar allows."""
        return self._matcher.validate_tokens(token_ids) if token_ids else 0

    def fill_masks(self, bitmask: torch.Tensor, first_row: int, token_ids: list[int]) -> None:
        """Write ``len(token_ids) + 1`` rows of ``bitmask`` ([rows, words] int32, CPU): the allowed
        tokens now, and after each of ``token_ids`` (which must all be allowed); state unchanged.

        Once a draft completes the grammar the state stays there (the rows after it allow only
        the end of text): llguidance takes the end-of-text token in that state without recording
        it, so rolling it back would undo one token too many."""
        consumed = 0
        for j in range(len(token_ids) + 1):
            row = bitmask[first_row + j]
            self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            if j == len(token_ids) or self._matcher.is_stopped():
                continue
            if not self._matcher.consume_token(token_ids[j]):
                raise ValueError(f"token {token_ids[j]} is not allowed by the grammar at draft position {j}")
            consumed += 1
        if consumed:
            self._matcher.rollback(consumed)

    def advance(self, output_token_ids: list[int]) -> int | None:
        """Consume the outputs past ``num_consumed``. Returns the number of output tokens the output
        should end at, else None: after the token that completed the grammar, or before the one it
        refused (llguidance offers a placeholder token where no real one can go on, and dies on it)."""
        while self.num_consumed < len(output_token_ids):
            if self.is_stopped or self.is_dead:
                return self.num_consumed
            if not self._matcher.consume_token(output_token_ids[self.num_consumed]):
                return self.num_consumed
            self.num_consumed += 1
        return self.num_consumed if self.is_stopped or self.is_dead else None
