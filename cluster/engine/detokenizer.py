"""Incremental detokenization with stop strings.

Text grows token by token without re-decoding the whole output: we decode a short
window (``prefix_offset:``) and keep only what is new, waiting while the window ends
in an incomplete UTF-8 character. A few prompt tokens seed the window so the first
output token gets its leading space right (SentencePiece tokenizers drop it alone).

Stop strings are never released: the text handed out lags the decoded text by
``len(longest stop) - 1`` characters until the request finishes, and on a match the
text is cut where the stop string begins.
"""

from __future__ import annotations

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
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # decoded so far (cut at a stop string once one matched)
        self._released = 0  # characters of ``text`` already handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string it completed, if any."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return None  # nothing printable yet (e.g. half of a multi-byte character)
        new_text = window[len(before) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
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
