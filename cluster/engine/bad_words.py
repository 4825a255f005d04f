"""vLLM's ``bad_words``: words the output may never contain, as token sequences.

A word is banned as the tokenizer writes it at the start of a text and, where that differs,
after a space (a word in mid-text usually starts with a space token of its own). At each step
the last token of a sequence is banned when the output so far ends with the rest of it
(``Request.bad_word_bans``), so the word can never be completed inside the output.
"""

from __future__ import annotations

from cluster.errors import ParamError

# What one request may ask for (vLLM's defaults): each step checks every sequence.
MAX_SEQUENCES = 128
MAX_TOTAL_TOKENS = 1024


def bad_word_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's token ids: as the start of a text, and after a space where that gives
    another first token and as many tokens (vLLM's rule, so both spellings are caught)."""
    sequences = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise ParamError("bad_words", f"bad_words entries must tokenize to at least one token, got {word!r}")
        sequences.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    total = sum(len(ids) for ids in sequences)
    if len(sequences) > MAX_SEQUENCES or total > MAX_TOTAL_TOKENS:
        raise ParamError("bad_words", f"bad_words come to {len(sequences)} token sequences of {total} tokens in "
                                      f"all; at most {MAX_SEQUENCES} and {MAX_TOTAL_TOKENS} are allowed")
    return sequences
