"""The error every request-parsing step raises for bad input: a ``ValueError`` whose
``param`` names the request field (OpenAI's error ``param``), which the ingress turns into
a 400 before anything is queued."""

from __future__ import annotations

from cluster.errors import ParamError


class UnsupportedFieldError(ParamError):
    """A request field that is wrong or that Tandem does not implement; ``param`` names it."""
