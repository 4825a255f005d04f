"""The error every request-parsing step raises for bad input: a ``ValueError`` whose
``param`` names the request field (OpenAI's error ``param``), which the ingress turns into
a 400 before anything is queued."""

from __future__ import annotations

import re

from cluster.errors import ParamError


class UnsupportedFieldError(ParamError):
    """A request field that is wrong or that Tandem does not implement; ``param`` names it."""


def renamed_error(message: str, param: str | None, names: dict[str, str]) -> tuple[str, str | None]:
    """An error about a request made from another body (a chat completion from a /v1/responses
    body), told in that body's field names: ``names`` maps each made field to the one it came
    from, and every such field the message names is renamed (two that became one are said once)."""
    for made, given in names.items():
        message = re.sub(rf"(?<![\w.]){re.escape(made)}\b", given, message)
    for given in set(names.values()):
        message = message.replace(f"'{given}' or '{given}'", f"'{given}'")
    return message, names.get(param, param)
