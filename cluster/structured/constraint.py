"""What a request's output must match, and the grammar that says it.

``StructuredOutputs`` is the request-level setting (vLLM's ``structured_outputs`` field:
exactly one of ``json``, ``regex``, ``choice``, ``grammar``). It is validated when built:
a schema or grammar that llguidance cannot compile raises ``ConstraintError`` naming the
request field it came from, so the HTTP layer answers 400 before anything is queued.

JSON whitespace is bounded by default: between JSON tokens only the separators ``", "``
and ``": "`` are allowed, so a small model cannot loop on newlines. ``flexible_whitespace``
lifts that (any run of JSON whitespace, as the JSON grammar allows).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from llguidance import LLMatcher

# The separators of bounded JSON (Python's json.dumps defaults): no other whitespace.
BOUNDED_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FLEXIBLE_JSON = {"whitespace_flexible": True}


class ConstraintError(ValueError):
    """A structured-output setting that cannot be compiled; ``param`` is the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: ``json`` (a JSON schema as a dict, or True for any JSON object),
    ``regex``, ``choice`` (the output is one of these strings) or ``grammar`` (a Lark grammar in
    llguidance's dialect, which may embed JSON schemas with ``%json {...}``). ``param`` names the
    request field the constraint came from, for error messages."""

    json: dict | bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    flexible_whitespace: bool = False
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ConstraintError(self.param, f"{self.param} must set exactly one of json, regex, choice or "
                                              f"grammar, got {', '.join(given) or 'none'}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice):
                raise ConstraintError(self.param, f"{self.param}.choice must be a list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ConstraintError(self.param, f"{self.param}: a JSON schema must be an object, got "
                                              f"{type(self.json).__name__}")
        error = LLMatcher.validate_grammar(self.grammar_text())
        if error and not error.startswith("WARNING"):
            raise ConstraintError(self.param, f"{self.param}: {_first_line(error)}")

    def grammar_text(self) -> str:
        """The llguidance grammar (what ``LLMatcher`` takes)."""
        if self.json is not None:
            schema = {"type": "object"} if self.json is True else self.json
            options = FLEXIBLE_JSON if self.flexible_whitespace else BOUNDED_JSON
            try:
                return LLMatcher.grammar_from_json_schema(schema, overrides=options)
            except ValueError as err:
                raise ConstraintError(self.param, f"{self.param}: not a JSON schema: {err}") from None
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            alternatives = " | ".join(json.dumps(c) for c in self.choice)
            return LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return LLMatcher.grammar_from_lark(self.grammar)


def json_schema_grammar(schema: dict, flexible_whitespace: bool = False) -> str:
    """A JSON schema as a Lark rule body (``%json {...}``) with the chosen whitespace, for
    grammars that embed JSON (tool calls)."""
    options = FLEXIBLE_JSON if flexible_whitespace else BOUNDED_JSON
    return "%json " + json.dumps({**schema, "x-guidance": options})


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return "; ".join(lines[:2]) if lines else message
