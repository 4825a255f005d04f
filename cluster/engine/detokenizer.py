"""Incremental detokenization with stop strings.

Text grows token by token without re-decoding the whole output. A fast tokenizer (one
backed by the ``tokenizers`` library) streams through that library's own ``DecodeStream``,
about a microsecond a token; any other decodes a short window (``prefix_offset:``) and
keeps only what is new, waiting while the window ends in an incomplete UTF-8 character
(about 20 microseconds a token through ``transformers``' ``decode``: the largest host
cost cProfile found in an H200 decode step at batch 128). Either way a few prompt tokens
seed the context so the first output token gets its leading space right (SentencePiece
tokenizers drop it alone).

Stop strings are never released: the text handed out lags the decoded text by
``len(longest stop) - 1`` characters until the request finishes, and on a match the
text is cut where the stop string begins (or, with ``include_stop``, where it ends, and
nothing is held back). As in vLLM, a stop string counts only once more than
``min_tokens`` tokens are out (it must end in a later token's text), and of several
completed by one token the one that ends first wins, then the first listed.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.hold_back = 0 if include_stop else max((len(s) for s in stop), default=1) - 1
        self.num_tokens = 0  # tokens added
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens) if self._backend else None
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # decoded so far (cut at a stop string once one matched)
        self._released = 0  # characters of ``text`` already handed out

    def _decode(self, ids: list[int]) -> str:
        # No tidying of spaces around punctuation (WordPiece's clean-up): tidied windows no longer
        # line up with each other, and the stream never tidies either.
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _new_text(self, token_id: int) -> str:
        """The text ``token_id`` adds; empty while it cannot print yet (half of a multi-byte character)."""
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window[len(before) :]

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string it completed, if any."""
        self.num_tokens += 1
        new_text = self._new_text(token_id)
        if not new_text:
            return None
        new_from = len(self.text)
        self.text += new_text
        if self.num_tokens <= self.min_tokens:
            return None
        return self._match_stop(new_from)

    def _match_stop(self, new_from: int) -> str | None:
        """The stop string that ends earliest in the text from ``new_from`` on (the new text)."""
        best: tuple[int, int, str] | None = None  # end, start, stop string
        for s in self.stop:
            start = self.text.find(s, max(0, new_from - len(s) + 1))
            if start != -1 and (best is None or start + len(s) < best[0]):
                best = (start + len(s), start, s)
        if best is None:
            return None
        end, start, stop = best
        self.text = self.text[: end if self.include_stop else start]
        return stop

    def release(self, finished: bool) -> str:
        """The text not yet handed out that can no longer become part of a stop string."""
        end = len(self.text) if finished or not self.stop else max(self._released, len(self.text) - self.hold_back)
        delta = self.text[self._released : end]
        self._released = end
        return delta

    @property
    def released_text(self) -> str:
        return self.text[: self._released]
