"""``tandem dashboards push`` against a fake of Grafana's HTTP API on loopback: the
folder is found or created, every dashboard is posted with overwrite into it, the
token goes as a bearer token, and failures become one clear line and a non-zero exit."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple

import pytest

from cluster.cli import main
from cluster.metrics.dashboards import dashboards
from cluster.metrics.grafana_push import GrafanaPushError, push_dashboards

TOKEN = "glsa_test_token"


class Call(NamedTuple):
    method: str
    path: str
    body: object
    authorization: str | None


class FakeGrafana:
    """Answers /api/folders and /api/dashboards/db like Grafana does, and records every call."""

    def __init__(self, folders: list[dict]) -> None:
        self.folders = list(folders)
        self.calls: list[Call] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                fake.handle(self, None)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                fake.handle(self, json.loads(self.rfile.read(length)) if length else None)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def handle(self, request: BaseHTTPRequestHandler, body) -> None:
        path = request.path.split("?")[0]
        auth = request.headers.get("Authorization")
        self.calls.append(Call(request.command, path, body, auth))
        if auth != f"Bearer {TOKEN}":
            return self.reply(request, 401, {"message": "invalid API key"})
        if (request.command, path) == ("GET", "/api/folders"):
            return self.reply(request, 200, self.folders)
        if (request.command, path) == ("POST", "/api/folders"):
            folder = {"id": len(self.folders) + 1, "uid": f"uid-{body['title'].lower()}", "title": body["title"]}
            self.folders.append(folder)
            return self.reply(request, 200, folder)
        if (request.command, path) == ("POST", "/api/dashboards/db"):
            uid = body["dashboard"]["uid"]
            return self.reply(request, 200, {"id": 7, "uid": uid, "url": f"/d/{uid}/x", "status": "success",
                                             "version": 3, "slug": "x"})
        return self.reply(request, 404, {"message": "Not found"})

    @staticmethod
    def reply(request: BaseHTTPRequestHandler, status: int, payload) -> None:
        data = json.dumps(payload).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def dashboard_posts(self) -> list[Call]:
        return [c for c in self.calls if (c.method, c.path) == ("POST", "/api/dashboards/db")]


@pytest.fixture()
def grafana():
    fakes: list[FakeGrafana] = []

    def start(folders: list[dict] = ()) -> FakeGrafana:
        fake = FakeGrafana(list(folders))
        fake.thread.start()
        fakes.append(fake)
        return fake

    yield start
    for fake in fakes:
        fake.server.shutdown()
        fake.server.server_close()


def test_push_creates_the_folder_and_posts_every_dashboard_with_overwrite(grafana):
    fake = grafana([{"id": 1, "uid": "other", "title": "Other"}])
    assert main(["dashboards", "push", "--url", fake.url, "--token", TOKEN]) == 0

    assert [(c.method, c.path) for c in fake.calls[:2]] == [("GET", "/api/folders"), ("POST", "/api/folders")]
    assert fake.calls[1].body == {"title": "Tandem"}
    posts = fake.dashboard_posts()
    assert len(posts) == len(fake.calls) - 2 == len(dashboards())
    assert [p.body["dashboard"]["uid"] for p in posts] == [d["uid"] for d in dashboards().values()]
    for post in posts:
        assert post.body["overwrite"] is True and post.body["folderUid"] == "uid-tandem"
        assert post.body["dashboard"]["id"] is None and post.body["dashboard"]["panels"]
    assert {c.authorization for c in fake.calls} == {f"Bearer {TOKEN}"}


def test_push_finds_an_existing_folder_by_title(grafana):
    fake = grafana([{"id": 1, "uid": "other", "title": "Other"}, {"id": 2, "uid": "llm-folder", "title": "LLM"}])
    pushed = push_dashboards(fake.url, TOKEN, list(dashboards().values()), folder="LLM")
    assert not [c for c in fake.calls if (c.method, c.path) == ("POST", "/api/folders")]
    assert {p.body["folderUid"] for p in fake.dashboard_posts()} == {"llm-folder"}
    assert [p.uid for p in pushed] == [d["uid"] for d in dashboards().values()]
    assert pushed[0].url == f"/d/{pushed[0].uid}/x" and pushed[0].version == 3


def test_push_to_general_needs_no_folder(grafana):
    fake = grafana()
    push_dashboards(fake.url, TOKEN, list(dashboards().values()), folder="")
    assert {c.path for c in fake.calls} == {"/api/dashboards/db"}
    assert all("folderUid" not in p.body for p in fake.dashboard_posts())


def test_wrong_token_is_a_clear_error_and_a_nonzero_exit(grafana, capsys):
    fake = grafana()
    with pytest.raises(GrafanaPushError, match="refused the token"):
        push_dashboards(fake.url, "wrong", list(dashboards().values()))
    assert fake.calls[0].authorization == "Bearer wrong"

    assert main(["dashboards", "push", "--url", fake.url, "--token", "wrong"]) == 1
    err = capsys.readouterr().err
    assert "401 Unauthorized" in err and "--token" in err and "Traceback" not in err
    assert not fake.dashboard_posts()


def test_unreachable_grafana_is_a_clear_error(capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["dashboards", "push", "--url", f"http://127.0.0.1:{port}", "--token", TOKEN]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: cannot reach Grafana at") and "Traceback" not in err


@pytest.mark.parametrize("argv, says", [
    (["--url", "grafana.example:3000", "--token", TOKEN], "--url must be Grafana's base URL"),
    (["--url", "http://127.0.0.1:9", "--token", " "], "token is needed"),
])
def test_bad_arguments_say_what_is_expected(argv, says, capsys, monkeypatch):
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    assert main(["dashboards", "push", *argv]) == 2
    assert says in capsys.readouterr().err


def test_url_and_token_may_come_from_the_environment(grafana, monkeypatch):
    fake = grafana([{"id": 1, "uid": "t", "title": "Tandem"}])
    monkeypatch.setenv("GRAFANA_URL", fake.url)
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    assert main(["dashboards", "push"]) == 0
    assert len(fake.dashboard_posts()) == len(dashboards())


def test_render_writes_the_files(tmp_path):
    configmap = tmp_path / "cm.yaml"
    assert main(["dashboards", "render", "--out", str(tmp_path / "out"), "--configmap", str(configmap)]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(dashboards())
    assert configmap.read_text().startswith("# Generated by `tandem dashboards render`")
