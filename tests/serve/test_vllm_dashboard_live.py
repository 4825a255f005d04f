"""vLLM's own example Grafana dashboard works on Tandem: the real Prometheus scrapes a running
``tandem serve`` at ``GET /metrics`` and answers every query of that dashboard
(``data/vllm_dashboard_queries.json``) with data, its ``model_name`` variable included."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.serve.conftest import MODEL, free_port

QUERIES = json.loads((Path(__file__).parent / "data" / "vllm_dashboard_queries.json").read_text())
SCRAPE_INTERVAL_S = 1


@pytest.fixture()
def prometheus(server_url, tmp_path):
    """The Prometheus server (Debian's, installed by `make install`) scraping the API's /metrics."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is not installed (make install puts Debian's there)")
    target = urlparse(server_url).netloc
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
        "scrape_configs": [{"job_name": "tandem", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [target]}]}]}))
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "prometheus.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while not _scraped_up(url):
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            assert time.time() < deadline, "Prometheus never scraped the server"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _scraped_up(url: str) -> bool:
    try:
        result = _query(url, 'up{job="tandem"}')
    except httpx.HTTPError:
        return False
    return bool(result) and result[0]["value"][1] == "1"


def _query(url: str, expr: str) -> list[dict]:
    body = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def test_every_query_of_vllms_dashboard_returns_data(prometheus, client):
    def traffic(rounds: int) -> None:
        for i in range(rounds):
            client.completions.create(model=MODEL, prompt=f"dashboard {i}", max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})

    traffic(3)
    time.sleep(4 * SCRAPE_INTERVAL_S)
    traffic(4)  # a second wave, scraped apart from the first, so every rate() sees an increase
    time.sleep(6 * SCRAPE_INTERVAL_S)

    names = httpx.get(f"{prometheus}/api/v1/label/model_name/values",
                      params={"match[]": '{__name__=~"vllm:.*"}'}, timeout=30).json()["data"]
    assert names == [MODEL]  # the dashboard's model_name variable offers the served model
    empty, not_finite = [], []
    for template in QUERIES["queries"]:
        expr = template.replace("$model_name", MODEL).replace("$__rate_interval", "1m")
        result = _query(prometheus, expr)
        if not result:
            empty.append(expr)
        elif not any(math.isfinite(float(r["value"][1])) for r in result):
            not_finite.append(expr)
    assert not empty, f"no data for {len(empty)} of vLLM's dashboard queries: {empty}"
    assert not not_finite, f"only NaN or Inf for: {not_finite}"
