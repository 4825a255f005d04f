"""The error every request-parsing step raises for bad input: a ``ValueError`` whose
``param`` names the request field (OpenAI's error ``param``), which the ingress turns into
a 400 before anything is queued."""

from __future__ import annotations


class UnsupportedFieldError(ValueError):
    """A request field that is wrong or that Tandem does not implement; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
