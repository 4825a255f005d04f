"""The Ray that ``tandem serve`` starts: Serve's controller loops at ``CONTROL_LOOP_INTERVAL_S``
(its processes inherit the variable), and the application is served all the same."""

from __future__ import annotations

from pathlib import Path

from deployments.local import CONTROL_LOOP_INTERVAL_S


def _environment_of(title: str) -> dict[str, str]:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "cmdline").read_bytes().startswith(title.encode()):
                pairs = (proc / "environ").read_bytes().split(b"\0")
                return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)
        except OSError:  # ended meanwhile
            continue
    raise AssertionError(f"no process titled {title!r}")


def test_serves_controller_loops_once_a_second(server_url, client):
    environment = _environment_of("ray::ServeController")
    assert environment.get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S") == CONTROL_LOOP_INTERVAL_S == "1"
    assert client.models.list().data  # and the application answers
