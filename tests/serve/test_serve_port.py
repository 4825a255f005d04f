"""``tandem serve`` waits for its port before starting Ray: Serve's ingress binds it without
SO_REUSEADDR, so a stopped server's closing connections (TIME_WAIT) would otherwise send the
ingress to another port of Serve's range while clients wait on this one (no Ray started here)."""

from __future__ import annotations

import socket
import time

import pytest

from deployments import local
from deployments.local import wait_for_free_port

HOST = "127.0.0.1"


def _listener() -> socket.socket:
    server = socket.socket()  # no SO_REUSEADDR, as Serve's ingress binds
    server.bind((HOST, 0))
    server.listen()
    return server


def _time_wait_port() -> int:
    """A port whose only socket is a connection the server side closed first (TIME_WAIT)."""
    server = _listener()
    port = server.getsockname()[1]
    client = socket.create_connection((HOST, port))
    accepted, _ = server.accept()
    accepted.close()  # the server closes first: TIME_WAIT lands on its side, on `port`
    client.recv(1)  # the server's FIN has arrived
    client.close()
    server.close()
    time.sleep(0.1)
    return port


def test_a_free_port_is_taken_without_waiting(capsys):
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    wait_for_free_port(HOST, port, timeout_s=5)
    assert "waiting" not in capsys.readouterr().out


def test_a_port_another_process_listens_on_fails_at_once():
    server = _listener()
    try:
        with pytest.raises(RuntimeError, match="in use by another process"):
            wait_for_free_port(HOST, server.getsockname()[1], timeout_s=30)
    finally:
        server.close()


def test_a_stopped_servers_closing_connections_are_waited_for(capsys):
    port = _time_wait_port()
    assert not local._binds(HOST, port)  # what Serve's ingress would meet
    with pytest.raises(RuntimeError, match="TIME_WAIT"):
        wait_for_free_port(HOST, port, timeout_s=0.5)
    assert f"waiting for port {port}" in capsys.readouterr().out


def test_the_wait_ends_when_the_port_comes_free(monkeypatch):
    answers = iter([False, False, True])  # TIME_WAIT twice, then free
    monkeypatch.setattr(local, "_binds", lambda host, port: next(answers))
    monkeypatch.setattr(local, "_listening", lambda host, port: False)
    monkeypatch.setattr(local.time, "sleep", lambda seconds: None)
    wait_for_free_port(HOST, 8123, timeout_s=30)
    assert next(answers, "drained") == "drained"
