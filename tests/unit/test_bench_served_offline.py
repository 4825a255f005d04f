"""`tandem bench served`'s offline engine cells: the closed loop keeps the cell's concurrency in
flight, every request finishes, and TTFT and TPOT are taken per request as vLLM's client takes them."""

from __future__ import annotations

import pytest
import yaml

from cluster.bench import served_offline
from cluster.engine.engine import Engine


class _CountingEngine(Engine):
    """The engine, noting how many requests were in it after every request added."""

    in_flight: list[int] = []

    def add_request(self, *args, **kwargs):
        request_id = super().add_request(*args, **kwargs)
        _CountingEngine.in_flight.append(self.scheduler.num_running + self.scheduler.num_waiting)
        return request_id


@pytest.fixture
def config(tmp_path, tiny_llama_dir):
    path = tmp_path / "served.yaml"
    path.write_text(yaml.safe_dump({"model": {"model": str(tiny_llama_dir), "dtype": "float32"},
                                    "serve": {"groups": [{"name": "default", "device_kind": "cpu", "num_cpus": 1}]}}))
    return path


@pytest.mark.parametrize("concurrency, most", [(2, 2), (None, 5)])
def test_the_offline_cell_holds_its_concurrency_and_finishes_every_request(monkeypatch, config, concurrency, most):
    monkeypatch.setattr(served_offline, "Engine", _CountingEngine)
    _CountingEngine.in_flight = []
    got = served_offline.offline_engine_figures(config, "random", num_prompts=5, input_len=8, output_len=6, seed=0,
                                                concurrency=concurrency, temperature=0.0)
    assert max(_CountingEngine.in_flight) == most and len(_CountingEngine.in_flight) == 5
    assert got["output_throughput"] * got["seconds"] == pytest.approx(5 * 6)
    assert got["concurrency"] == concurrency
    assert 0 < got["mean_ttft_ms"] and 0 < got["median_tpot_ms"]
    # a request's time after its first token spans its 5 later tokens: less than the whole run
    assert got["median_tpot_ms"] * 5 < 1000 * got["seconds"]
