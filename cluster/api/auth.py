"""API keys: which ones a server accepts, and checking a request's Authorization header.

Keys come from ``serve.api_key`` (one key or a list) and from the environment variable that
``serve.api_key_env`` names (one key, or several separated by commas: rotate by adding the
new key, moving clients, then dropping the old one). Every accepted key is compared with
``hmac.compare_digest`` (time independent of where the strings differ), and all of them are
compared, so the time taken says nothing about which key came close.
"""

from __future__ import annotations

import hmac
import os


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        self.keys = [k.encode() for k in keys if k]

    @classmethod
    def from_settings(cls, api_key: str | list[str] | None, api_key_env: str | None) -> ApiKeys:
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        if api_key_env:
            keys += [k.strip() for k in os.environ.get(api_key_env, "").split(",")]
        return cls(keys)

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def refusal(self, authorization: str) -> str | None:
        """None when the header carries an accepted key (or no key is required); else why not."""
        if not self.keys:
            return None
        if not authorization:
            return "missing"
        scheme, _, token = authorization.partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(given, key)
        return None if matched else "incorrect"
