"""API keys: several accepted, from the config and a comma-separated environment variable."""

from __future__ import annotations

import hmac

from cluster.api.auth import ApiKeys
from cluster.config_serve import ServeConfig


def test_no_key_configured_lets_everything_through():
    assert ApiKeys.from_settings(None, None).refusal("") is None
    assert not ApiKeys.from_settings(None, "TANDEM_TEST_UNSET_VAR").required


def test_several_keys_from_config_and_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_TEST_KEYS", "new-key, old-key,")
    keys = ApiKeys.from_settings(["admin-key"], "TANDEM_TEST_KEYS")
    for key in ("admin-key", "new-key", "old-key"):
        assert keys.refusal(f"Bearer {key}") is None
        assert keys.refusal(f"bearer {key}") is None  # the scheme is case-insensitive (RFC 7235)
    assert keys.refusal("") == "missing"
    assert keys.refusal("Bearer ") == "incorrect"  # an empty entry in the variable is no key
    assert keys.refusal("Bearer admin-key2") == "incorrect"
    assert keys.refusal("Basic admin-key") == "incorrect"


def test_every_key_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(b) or real(a, b))
    ApiKeys(["a", "b", "c"]).refusal("Bearer a")
    assert calls == [b"a", b"b", b"c"]  # no early exit on the first match


def test_the_config_takes_one_key_or_a_list():
    assert ServeConfig(api_key="k").api_key == "k"
    assert ServeConfig(api_key=["k1", "k2"]).api_key == ["k1", "k2"]
