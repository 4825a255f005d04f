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
text is cut where the stop string begins.
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
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
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
        new_text = self._new_text(token_id)
        if not new_text:
            return None
        search_from = max(0, len(self.text) - self.hold_back)
        self.text += new_text
        return self._match_stop(search_from)

    def _match_stop(self, search_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def release(self, finished: bool) -> str:
        """The text not yet handed out that can no longer become part of a stop string."""
        end = len(self.text) if finished or not self.stop else max(self._released, len(self.text) - self.hold_back)
        delta = self.text[self._released : end]
        self._released = end
        return delta

    @property
    def released_text(self) -> str:
        return self.text[: self._released]
