"""Random JSON schemas for the structured-output tests: nested objects, arrays,
enums, bounded numbers and strings, drawn from a seeded ``random.Random``.

Every schema is satisfiable and every value it admits is short (strings and arrays carry
upper bounds), so a model that follows the grammar finishes well within a few hundred tokens.
"""

from __future__ import annotations

import random

_WORDS = ["name", "title", "city", "color", "score", "count", "price", "tags", "owner", "status", "level",
          "items", "size", "enabled", "rating", "year", "kind", "notes", "email", "code"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema with 1-4 properties; nested objects and arrays down to depth 2."""
    names = rng.sample(_WORDS, rng.randint(1, 4))
    properties = {name: _value_schema(rng, depth + 1) for name in names}
    required = [n for n in names if rng.random() < 0.8] or names[:1]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _value_schema(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 16)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 1000)}
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 100)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no", "open"], rng.randint(2, 4))}
    if kind == "object":
        return random_schema(rng, depth)
    return {"type": "array", "items": _value_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(2, 4)}


def random_schemas(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]
