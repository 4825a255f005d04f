"""Incremental detokenization: the streamed text is ``transformers``' decode of the whole output.

The reference is ``tokenizer.decode`` of every output id at once (spaces never tidied). Both ways of streaming are
checked against it: the ``tokenizers`` library's ``DecodeStream`` (fast tokenizers) and the
window re-decode (any other tokenizer, and those that tidy spaces after decoding).
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.models.loader import load_tokenizer, resolve_model
from cluster.models.tiny import save_tiny_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 8,
    "日本語のテキスト 🎉🚀 emoji и кириллица, ñandú; ½ → ∞",
    "<|im_start|>user\nhi there<|im_end|>\n  spaces   and\ttabs\n\n",
    "x",
]


class WindowOnly:
    """A tokenizer seen without its ``tokenizers`` backend: the window path."""

    def __init__(self, tokenizer) -> None:
        self.inner = tokenizer

    def decode(self, ids, **kwargs):
        return self.inner.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


def stream(tokenizer, prompt, ids, skip=True, stop=()):
    detok = IncrementalDetokenizer(tokenizer, prompt, list(stop), skip)
    released, matched = "", None
    for token in ids:
        matched = detok.add_token(token)
        released += detok.release(finished=matched is not None)
        if matched is not None:
            break
    released += detok.release(finished=True)
    return detok, released, matched


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_the_whole_decode(smollm2, text, skip):
    ids = smollm2(text)["input_ids"]
    reference = smollm2.decode(ids, skip_special_tokens=skip)
    for prompt in ([], ids[:3], smollm2("Hello there")["input_ids"]):
        for tokenizer in (smollm2, WindowOnly(smollm2)):
            detok, released, _ = stream(tokenizer, prompt, ids, skip)
            assert detok.text == released == reference, (type(tokenizer).__name__, prompt)


def test_the_library_stream_is_taken_for_fast_tokenizers(smollm2):
    assert IncrementalDetokenizer(smollm2, [], [])._stream is not None
    assert IncrementalDetokenizer(WindowOnly(smollm2), [], [])._stream is None


def test_a_tokenizer_that_tidies_spaces_streams_its_tokens_own_text(tmp_path):
    # transformers tidies BPE output only when told twice (the tidy step was made for WordPiece).
    tokenizer = AutoTokenizer.from_pretrained(
        save_tiny_tokenizer(tmp_path / "tiny"), clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    ids = tokenizer("hello , world . it 's")["input_ids"]
    assert tokenizer.decode(ids) == "hello, world. it's"  # what a tidied whole decode would give
    for streamed in (tokenizer, WindowOnly(tokenizer)):
        detok, released, _ = stream(streamed, [], ids)
        assert released == detok.text == "hello , world . it 's"


@pytest.mark.parametrize("tokenizer_kind", ["stream", "window"])
def test_a_stop_string_cuts_the_text_and_is_never_released(smollm2, tokenizer_kind):
    tokenizer = smollm2 if tokenizer_kind == "stream" else WindowOnly(smollm2)
    ids = smollm2("Count: one, two, three, four, five.")["input_ids"]
    detok, released, matched = stream(tokenizer, [], ids, stop=["three", "zebra"])
    assert matched == "three"
    assert released == detok.text == "Count: one, two, "


def added_until_stop(tokenizer, ids, stop, min_tokens=0, include_stop=False):
    """Feed ``ids`` one at a time: (tokens added when a stop string matched or all of them, the
    stop string, the released text)."""
    detok = IncrementalDetokenizer(tokenizer, [], list(stop), True, min_tokens, include_stop)
    released = ""
    for token in ids:
        matched = detok.add_token(token)
        released += detok.release(finished=matched is not None)
        if matched is not None:
            return detok.num_tokens, matched, released
    return detok.num_tokens, None, released + detok.release(finished=True)


def token_texts(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    return ids, [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]


def test_with_include_stop_the_text_ends_after_the_stop_string(smollm2):
    ids, _ = token_texts(smollm2, "Count: one, two, three, four, five.")
    _, matched, released = added_until_stop(smollm2, ids, ["three"], include_stop=True)
    assert (matched, released) == ("three", "Count: one, two, three")


def test_stop_strings_count_only_after_min_tokens(smollm2):
    """vLLM's rule: a stop string must end in the text of a token past the first ``min_tokens``."""
    ids, prefixes = token_texts(smollm2, "a, b, c, d, e, f")
    first_comma = next(i for i, p in enumerate(prefixes) if "," in p)  # index of the token that writes it
    n, matched, released = added_until_stop(smollm2, ids, [","])
    assert (n, matched, released) == (first_comma + 1, ",", "a")
    # With min_tokens covering the first comma's token, the next comma stops it.
    n, matched, released = added_until_stop(smollm2, ids, [","], min_tokens=first_comma + 1)
    second_comma = next(i for i, p in enumerate(prefixes) if p.count(",") == 2)
    assert (n, matched, released) == (second_comma + 1, ",", "a, b")


def test_of_two_stop_strings_completed_by_one_token_the_one_ending_first_wins(smollm2):
    ids = smollm2(" the cat sat")["input_ids"]
    one = smollm2(" abc")["input_ids"]
    assert len(one) == 1  # one token writes all three letters
    # "abc" begins first but "ab" ends first: vLLM keeps the text before "ab".
    for stop in (["abc", "ab"], ["ab", "abc"]):
        _, matched, released = added_until_stop(smollm2, ids + one, stop)
        assert (matched, released) == ("ab", " the cat sat ")
