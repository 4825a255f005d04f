"""llguidance's view of a model's vocabulary: the bytes of every token id.

Built once per engine (about 0.3 s for a 49k-token vocabulary). Hugging Face fast tokenizers
with byte-level or byte-fallback decoding are read by llguidance itself; others (such as the
character-level tokenizer of the tiny test models) are described token by token from their
single-token decodings, which is exact for tokenizers whose tokens decode independently.
"""

from __future__ import annotations

from llguidance import LLTokenizer
from llguidance.hf import from_tokenizer
from llguidance._tokenizer import TokenizerWrapper


class _TokenBytes:
    """What ``TokenizerWrapper`` asks of a tokenizer: each id's bytes, the special ids, encoding."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int) -> None:
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(set(tokenizer.all_special_ids))
        special = set(self.special_token_ids)
        known = len(tokenizer)
        # llguidance marks special tokens with a leading 0xff byte; ids past the tokenizer's own
        # get such a name too, so no text can ever produce them.
        self.tokens = [tokenizer.decode([i]).encode("utf-8") if i < known and i not in special
                       else b"\xff" + (tokenizer.convert_ids_to_tokens(i) if i < known else f"<unused{i}>").encode()
                       for i in range(vocab_size)]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


def grammar_tokenizer(tokenizer, vocab_size: int, eos_token_id: int | None) -> LLTokenizer:
    """``tokenizer``: the model's Hugging Face tokenizer; ``vocab_size``: the width of its logits
    (ids past the tokenizer's own can never be allowed)."""
    eos = eos_token_id if eos_token_id is not None else tokenizer.eos_token_id
    try:
        return from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    except ValueError:  # a decoder llguidance does not read from tokenizer.json
        return LLTokenizer(TokenizerWrapper(_TokenBytes(tokenizer, vocab_size, eos)), n_vocab=vocab_size)
