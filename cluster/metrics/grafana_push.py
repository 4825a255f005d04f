"""Provision Tandem's dashboards into a running Grafana through its HTTP API
(``grafana-client``), for ``tandem dashboards push``.

The folder is looked up by title among the top-level folders and created when missing
(an empty title means Grafana's "General" / root). Each dashboard is then posted to
``/api/dashboards/db`` with ``overwrite: true``: dashboards keep their stable ``uid``, so
pushing again updates them in place. Any failure (bad URL, unreachable server, refused
token, an error status) is raised as ``GrafanaPushError`` with a message meant for the
user, never a transport exception.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple
from urllib.parse import urlparse

DEFAULT_FOLDER = "Tandem"
PUSH_MESSAGE = "tandem dashboards push"


class GrafanaPushError(RuntimeError):
    """Grafana could not be reached or refused a request; the message says which and why."""


class PushedDashboard(NamedTuple):
    title: str
    uid: str
    url: str  # where Grafana serves it, relative to its root
    version: int | None


def push_dashboards(url: str, token: str, dashboards: list[dict], folder: str = DEFAULT_FOLDER,
                    timeout_s: float = 10.0) -> list[PushedDashboard]:
    """Create or update every dashboard in ``folder`` of the Grafana at ``url``,
    authenticating with ``token`` (a service account token or API key, sent as a
    bearer token). Raises ``ValueError`` for a malformed URL or an empty token and
    ``GrafanaPushError`` when Grafana cannot be reached or says no."""
    # here, not at the top: grafana-client would add ~0.09 s to every tandem command, for this command only
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(_check_url(url), credential=_check_token(token), timeout=timeout_s)
    with _explained(url):
        folder_uid = _folder_uid(api, folder) if folder else None
        pushed = []
        for dashboard in dashboards:
            body = {"dashboard": {**dashboard, "id": None}, "overwrite": True, "message": PUSH_MESSAGE}
            if folder_uid is not None:
                body["folderUid"] = folder_uid
            answer = api.dashboard.update_dashboard(body)
            pushed.append(PushedDashboard(dashboard["title"], answer.get("uid", dashboard["uid"]),
                                          answer.get("url", ""), answer.get("version")))
    return pushed


def _folder_uid(api, title: str) -> str:
    for existing in api.folder.get_all_folders():
        if existing.get("title") == title:
            return existing["uid"]
    return api.folder.create_folder(title)["uid"]


def _check_url(url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"--url must be Grafana's base URL such as http://grafana.example:3000, got {url!r}")
    # grafana-client appends "api" to the path: a sub-path install needs its trailing slash.
    if parsed.path and not parsed.path.endswith("/"):
        url = parsed._replace(path=parsed.path + "/").geturl()
    return url


def _check_token(token: str) -> str:
    if not token or not token.strip():
        raise ValueError("a Grafana token is needed: pass --token or set GRAFANA_TOKEN "
                         "(a service account token with the Editor role)")
    return token.strip()


@contextmanager
def _explained(url: str) -> Iterator[None]:
    """Turns grafana-client's and niquests' exceptions into ``GrafanaPushError``."""
    # here, not at the top: grafana-client would add ~0.09 s to every tandem command, for this command only
    from grafana_client.client import GrafanaException, GrafanaTimeoutError
    from niquests.exceptions import RequestException

    try:
        yield
    except GrafanaTimeoutError as exc:
        raise GrafanaPushError(f"Grafana at {url} did not answer in time") from exc
    except GrafanaException as exc:
        raise GrafanaPushError(_status_message(url, exc.status_code, exc.message)) from exc
    except RequestException as exc:
        raise GrafanaPushError(f"cannot reach Grafana at {url}: {exc}") from exc


def _status_message(url: str, status: int, detail: str) -> str:
    if status == 401:
        return (f"Grafana at {url} refused the token (401 Unauthorized): check --token; it must be a "
                "valid service account token or API key of this Grafana")
    if status == 403:
        return (f"Grafana at {url} denied access (403 Forbidden): the token needs the Editor role to "
                "create folders and dashboards")
    if status == 404:
        return f"Grafana at {url} answered 404 Not Found: is --url Grafana's base URL?"
    if status == 0:
        return f"cannot reach Grafana at {url}: {detail}"
    return f"Grafana at {url} answered {status}: {detail}"
