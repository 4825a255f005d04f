"""API keys: which ones a server accepts, and checking a request's Authorization header.

Keys come from ``serve.api_key`` (one key or a list), from the environment variable that
``serve.api_key_env`` names, and from the file ``serve.api_key_file`` names (one key, or
several separated by commas or lines: rotate by adding the new key, moving clients, then
dropping the old one). The file is read again whenever it changes (a Kubernetes Secret
mounted as a volume is updated in place by the kubelet), so rotating keys there needs no
restart; a file that cannot be read keeps the keys last read. Every accepted key is compared with
``hmac.compare_digest`` (time independent of where the strings differ), and all of them are
compared, so the time taken says nothing about which key came close.
"""

from __future__ import annotations

import hmac
import os
import time
from pathlib import Path


FILE_CHECK_INTERVAL_S = 1.0


def _split(text: str) -> list[str]:
    return [k.strip() for k in text.replace("\n", ",").split(",") if k.strip()]


class ApiKeys:
    def __init__(self, keys: list[str], key_file: str | None = None) -> None:
        """``keys``: those fixed at start; ``key_file``: a file of further keys, re-read when it changes."""
        self._fixed = [k.encode() for k in keys if k]
        self.key_file = Path(key_file) if key_file else None
        self._from_file: list[bytes] = []
        self._file_stamp: tuple[int, int] | None = None
        self._next_check = 0.0
        if self.key_file is not None:
            self._reload(force=True)

    @classmethod
    def from_settings(cls, api_key: str | list[str] | None, api_key_env: str | None,
                      api_key_file: str | None = None) -> ApiKeys:
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        if api_key_env:
            keys += _split(os.environ.get(api_key_env, ""))
        return cls(keys, api_key_file)

    @property
    def keys(self) -> list[bytes]:
        if self.key_file is not None:
            self._reload()
        return self._fixed + self._from_file

    @property
    def required(self) -> bool:
        return bool(self._fixed) or self.key_file is not None

    def _reload(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_check:
            return
        self._next_check = now + FILE_CHECK_INTERVAL_S
        try:
            stat = self.key_file.stat()
            stamp = (stat.st_mtime_ns, stat.st_ino)  # a Secret volume swaps a symlink: a new inode
            if stamp == self._file_stamp:
                return
            self._from_file = [k.encode() for k in _split(self.key_file.read_text())]
            self._file_stamp = stamp
        except OSError as err:
            if force:
                raise ValueError(f"serve.api_key_file {self.key_file} cannot be read: {err}") from None
            # keep the keys last read: a Secret being updated is briefly absent

    def refusal(self, authorization: str) -> str | None:
        """None when the header carries an accepted key (or no key is required); else why not."""
        keys = self.keys
        if not self.required:
            return None
        if not keys:
            return "not configured (the key file holds none)"
        if not authorization:
            return "missing"
        scheme, _, token = authorization.partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(given, key)
        return None if matched else "incorrect"
