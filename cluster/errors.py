"""The error of bad input: a ``ValueError`` whose ``param`` names the request field it is about
(OpenAI's error ``param``), so no layer has to guess the field from the message."""

from __future__ import annotations


class ParamError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class NotFoundError(ParamError):
    """Bad input that names something not there (a model or an adapter): HTTP 404, not 400."""


def require_unicode(text: str, param: str, error: type[ParamError] = ParamError) -> None:
    """Raise ``error`` (a ParamError) when ``text`` cannot be UTF-8 (a lone surrogate, which
    JSON's ``\\udcff`` escapes can carry and tokenizers refuse with an unhelpful TypeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise error(param, f"{param} is not valid Unicode: {err.object[err.start]!r} at character "
                                f"{err.start} is a lone surrogate; send UTF-8 text") from None
