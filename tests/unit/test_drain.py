"""``tandem serve``'s drain waits through a hub that is slow to answer (a loaded machine) and
stops early only when the hub or Ray is gone. The hub and ``ray.get`` are stand-ins: the
drain's loop is what is checked (tests/serve/test_sigterm_drain.py runs the real thing)."""

from __future__ import annotations

import ray

from deployments import local


class _Hub:
    """Answers ``drain`` and ``drain_status`` with the given replies, in order (the last repeats)."""

    def __init__(self, statuses):
        self.statuses = list(statuses)
        self.drained = 0
        hub = self

        class _Call:
            def __init__(self, name):
                self.name = name

            def remote(self, *args):
                if self.name == "drain":
                    hub.drained += 1
                    return ("drain", None)
                return ("status", hub.statuses.pop(0) if len(hub.statuses) > 1 else hub.statuses[0])

        self.drain, self.drain_status = _Call("drain"), _Call("status")


def _get_failing(times: int, error: Exception):
    """A ``ray.get`` that raises ``error`` on its first ``times`` calls, then returns the reply."""
    calls = {"n": 0}

    def get(ref, timeout=None):
        calls["n"] += 1
        if calls["n"] <= times:
            raise error
        return ref[1]
    return get


def test_a_slow_hub_is_asked_again_until_every_call_has_finished(monkeypatch, capsys):
    hub = _Hub([(1, 1, 2), (1, 1, 1), (1, 1, 0)])
    monkeypatch.setattr(local, "application_hub", lambda app_name: hub)
    monkeypatch.setattr(local.ray, "get", _get_failing(3, ray.exceptions.GetTimeoutError("slow")))
    monkeypatch.setattr(local.time, "sleep", lambda s: None)
    local.drain("app", timeout_s=30)
    out = capsys.readouterr().out
    assert "drained: no request in flight" in out, out
    assert "stopped early" not in out
    assert hub.drained == 4  # told again after each of the three slow answers (drain is idempotent)
    assert hub.statuses == [(1, 1, 0)]  # every status before the last was read


def test_a_hub_gone_ends_the_drain_at_once(monkeypatch, capsys):
    hub = _Hub([(1, 1, 1)])
    monkeypatch.setattr(local, "application_hub", lambda app_name: hub)
    monkeypatch.setattr(local.ray, "get", _get_failing(1, ray.exceptions.RayActorError()))
    local.drain("app", timeout_s=30)
    out = capsys.readouterr().out
    assert "draining stopped early (RayActorError" in out, out
    assert "drained" not in out.replace("draining", "")


def test_calls_still_in_flight_at_the_bound_are_counted(monkeypatch, capsys):
    hub = _Hub([(1, 1, 3)])
    clock = {"t": 0.0}

    def sleep(s):
        clock["t"] += 1.0

    monkeypatch.setattr(local, "application_hub", lambda app_name: hub)
    monkeypatch.setattr(local.ray, "get", _get_failing(2, ray.exceptions.GetTimeoutError("slow")))
    monkeypatch.setattr(local.time, "sleep", sleep)
    monkeypatch.setattr(local.time, "monotonic", lambda: clock["t"])
    local.drain("app", timeout_s=5)
    out = capsys.readouterr().out
    assert "3 request(s) still in flight after 5 s (the hub was slow to answer 2 time(s))" in out, out
