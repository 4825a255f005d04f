"""The error of bad input: a ``ValueError`` whose ``param`` names the request field it is about
(OpenAI's error ``param``), so no layer has to guess the field from the message."""

from __future__ import annotations


class ParamError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
