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


def test_keys_in_a_file_rotate_without_a_restart(tmp_path, monkeypatch):
    """A Kubernetes Secret mounted as a volume: the kubelet swaps the file's target (a new inode)."""
    import cluster.api.auth as auth

    monkeypatch.setattr(auth, "FILE_CHECK_INTERVAL_S", 0.0)
    secret = tmp_path / "api-key"
    secret.write_text("old-key\n")
    keys = ApiKeys.from_settings(None, None, str(secret))
    assert keys.required and keys.refusal("Bearer old-key") is None
    staged = tmp_path / "api-key.new"
    staged.write_text("old-key,new-key")  # step 1 of a rotation: both
    staged.replace(secret)
    assert keys.refusal("Bearer new-key") is None and keys.refusal("Bearer old-key") is None
    staged.write_text("new-key")  # step 3: the old one dropped
    staged.replace(secret)
    assert keys.refusal("Bearer old-key") == "incorrect" and keys.refusal("Bearer new-key") is None
    secret.unlink()  # briefly absent while the kubelet swaps it: the last keys stay
    assert keys.refusal("Bearer new-key") is None
    secret.write_text("")
    assert keys.refusal("Bearer new-key") == "not configured (the key file holds none)"


def test_a_key_file_that_cannot_be_read_at_start_is_an_error(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="api_key_file"):
        ApiKeys.from_settings(None, None, str(tmp_path / "missing"))
