"""The direct-ingress listener binds ``serve.port`` over the lingering connections of the
listener before it (``SO_REUSEADDR``, ``deployments/ingress_port.py``) and never beside a live
listener; ``tandem serve`` checks the port the same way before it starts Ray, and waits while
connections of a listener that did not allow reuse linger (no Ray started here: Serve's own
listener function runs on this test's event loop)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from deployments import ingress_port, local
from deployments.ingress_port import binds, reuse_address
from deployments.local import wait_for_free_port

HOST = "127.0.0.1"


def _listener(reuse: bool = False) -> socket.socket:
    server = socket.socket()
    if reuse:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((HOST, 0))
    server.listen()
    return server


def _lingering_port(reuse: bool) -> int:
    """A port whose only socket is a connection its server closed first (TIME_WAIT), accepted by
    a listener with or without ``SO_REUSEADDR`` (the patched ingress's, or Ray Serve's own)."""
    server = _listener(reuse)
    port = server.getsockname()[1]
    client = socket.create_connection((HOST, port))
    accepted, _ = server.accept()
    accepted.close()  # the server closes first: TIME_WAIT lands on its side, on `port`
    client.recv(1)  # the server's FIN has arrived
    client.close()
    server.close()
    time.sleep(0.1)
    with socket.socket() as plain, pytest.raises(OSError):  # a bind without SO_REUSEADDR still fails
        plain.bind((HOST, port))
    return port


def test_the_ingress_listeners_own_lingering_connections_do_not_hold_the_port(capsys):
    port = _lingering_port(reuse=True)
    assert binds(HOST, port)
    wait_for_free_port(HOST, port, timeout_s=5)
    assert "waiting" not in capsys.readouterr().out


def test_a_port_another_process_listens_on_fails_at_once():
    server = _listener(reuse=True)
    try:
        assert not binds(HOST, server.getsockname()[1])
        with pytest.raises(RuntimeError, match="in use by another process"):
            wait_for_free_port(HOST, server.getsockname()[1], timeout_s=30)
    finally:
        server.close()


def test_connections_of_a_listener_without_reuse_are_waited_for(capsys):
    port = _lingering_port(reuse=False)
    assert not binds(HOST, port)
    with pytest.raises(RuntimeError, match="TIME_WAIT"):
        wait_for_free_port(HOST, port, timeout_s=0.5)
    assert f"waiting for port {port}" in capsys.readouterr().out


def test_the_wait_ends_when_the_port_comes_free(monkeypatch):
    answers = iter([False, False, True])  # lingering twice, then free
    monkeypatch.setattr(local, "binds", lambda host, port: next(answers))
    monkeypatch.setattr(local, "_listening", lambda host, port: False)
    monkeypatch.setattr(local.time, "sleep", lambda seconds: None)
    wait_for_free_port(HOST, 8123, timeout_s=30)
    assert next(answers, "drained") == "drained"


async def _hello(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _serve_once(port: int) -> bytes:
    """Start Serve's direct-ingress listener as a replica starts it, answer one request, stop."""
    from ray.serve._private import replica
    from ray.serve.config import HTTPOptions

    task, server = await replica.start_asgi_http_server(_hello, HTTPOptions(host=HOST, port=port),
                                                        event_loop=asyncio.get_running_loop(),
                                                        enable_so_reuseport=False)
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = await reader.read()
        writer.close()
        return answer
    finally:
        server.should_exit = True
        await task


def test_serves_listener_binds_over_its_lingering_connections_once_wrapped(monkeypatch):
    from ray.serve._private import http_util, replica

    for module, name in ((replica, "start_asgi_http_server"), (http_util, "set_socket_reuse_port")):
        monkeypatch.setattr(module, name, getattr(module, name))  # put back after the test
    port = _lingering_port(reuse=True)
    with pytest.raises(RuntimeError, match="Failed to bind"):  # Ray Serve's listener as it comes
        asyncio.run(_serve_once(port))
    assert reuse_address() and reuse_address()  # idempotent
    assert http_util.set_socket_reuse_port is ingress_port._set_reuse_address
    assert asyncio.run(_serve_once(port)).endswith(b"ok")
    server = _listener(reuse=True)
    try:  # never beside a live listener: SO_REUSEPORT stays off
        with pytest.raises(RuntimeError, match="Failed to bind"):
            asyncio.run(_serve_once(server.getsockname()[1]))
    finally:
        server.close()
