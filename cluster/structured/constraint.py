"""What a request's output must match, and the grammar that says it.

``StructuredOutputs`` is the request-level setting (vLLM's ``structured_outputs`` field:
exactly one of ``json``, ``regex``, ``choice``, ``grammar``). It is validated when built:
a schema or grammar that llguidance cannot compile raises ``ConstraintError`` naming the
request field it came from, so the HTTP layer answers 400 before anything is queued.

JSON is bounded by default, so a small model cannot loop inside a value: between JSON
tokens only the separators ``", "`` and ``": "`` are allowed (no newlines), a number without
``multipleOf`` has at most six decimal places, and an integer or number without bounds stays
within +-10^15. ``flexible_whitespace`` lifts the whitespace bound (any run of JSON
whitespace); a schema's own ``multipleOf``, ``minimum`` and ``maximum`` replace the others.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from llguidance import LLMatcher

from cluster.errors import ParamError, require_unicode

# The separators of bounded JSON (Python's json.dumps defaults): no other whitespace.
BOUNDED_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FLEXIBLE_JSON = {"whitespace_flexible": True}
NUMBER_STEP = 1e-6  # the finest number a schema without multipleOf gets
NUMBER_LIMIT = 10**15  # |value| for integers and numbers without bounds


class ConstraintError(ParamError):
    """A structured-output setting that cannot be compiled; ``param`` is the request field."""


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
        for text in (self.regex, self.grammar, *(self.choice or ())):
            if isinstance(text, str):  # llguidance would raise its codec's error, naming no field
                require_unicode(text, self.param, ConstraintError)
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ConstraintError(self.param, f"{self.param}: a JSON schema must be an object, got "
                                              f"{type(self.json).__name__}")
        error = LLMatcher.validate_grammar(self.grammar_text())
        if error and not error.startswith("WARNING"):
            raise ConstraintError(self.param, f"{self.param}: {_first_line(error)}")

    def grammar_text(self) -> str:
        """The llguidance grammar (what ``LLMatcher`` takes)."""
        if self.json is not None:
            schema = bounded_numbers({"type": "object"} if self.json is True else self.json)
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


def vllm_fields(constraint: StructuredOutputs) -> dict:
    """The keyword arguments of vLLM's ``StructuredOutputsParams`` that give a vLLM engine with the
    ``guidance`` backend (llguidance, the same library) the same grammar: regex and choice as vLLM
    builds them (identically), a JSON schema as a Lark grammar embedding it with our bounds."""
    if constraint.regex is not None:
        return {"regex": constraint.regex}
    if constraint.choice is not None:
        return {"choice": list(constraint.choice)}
    if constraint.grammar is not None:
        return {"grammar": constraint.grammar}
    schema = {"type": "object"} if constraint.json is True else constraint.json
    return {"grammar": "start: " + json_schema_grammar(schema, constraint.flexible_whitespace)}


def json_schema_grammar(schema: dict, flexible_whitespace: bool = False) -> str:
    """A JSON schema as a Lark rule body (``%json {...}``) with the chosen whitespace, for
    grammars that embed JSON (tool calls)."""
    options = FLEXIBLE_JSON if flexible_whitespace else BOUNDED_JSON
    return "%json " + json.dumps({**bounded_numbers(schema), "x-guidance": options})


def bounded_numbers(schema):
    """A copy of ``schema`` whose number and integer nodes carry the default precision and bounds
    where they set none (see the module's docstring)."""
    if isinstance(schema, list):
        return [bounded_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded_numbers(value) for key, value in schema.items()}
    kinds = out.get("type")  # a name, a list of names, or (a property called "type") a schema
    kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()
    if kinds & {"number", "integer"}:
        if "number" in kinds and "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -NUMBER_LIMIT
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = NUMBER_LIMIT
    return out


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return "; ".join(lines[:2]) if lines else message
