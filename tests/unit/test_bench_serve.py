"""``tandem bench serve``: hand-computed metrics, the arrival process, and end-to-end runs
against a tiny fake OpenAI server (aiohttp.web on a free port). No timing assertions."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import threading

import pytest
from aiohttp import web

from cluster.bench.serve import ServeBenchOptions, run_serve_benchmark
from cluster.bench.serve_metrics import RequestRecord, parse_goodput, parse_percentiles, summarize
from cluster.bench.serve_workload import (
    BenchRequest, Phase, arrival_times, instruction_requests, load_instructions, parse_phases,
    phased_arrival_times, random_requests, shared_prefix_requests,
)
from cluster.cli import main


def _record(index, chunk_times, output_tokens, e2e, prompt_tokens, success=True):
    return RequestRecord(index=index, scheduled_s=0.0, start_s=0.0, success=success, error="" if success else "x",
                         prompt_len=prompt_tokens, output_len=output_tokens, prompt_tokens=prompt_tokens,
                         output_tokens=output_tokens, output_tokens_source="usage", e2e_s=e2e,
                         chunk_times_s=tuple(chunk_times))


# A: TTFT 100 ms, ITL 200 and 300 ms, 3 tokens, E2E 600 ms -> TPOT (600 - 100) / 2 = 250 ms
# B: TTFT 200 ms, ITL 100 ms, 2 tokens, E2E 400 ms -> TPOT 200 ms
# C: TTFT 500 ms, 1 token, E2E 500 ms -> no TPOT, no ITL
# D: failed; counts nowhere but in "failed"
RECORDS = [_record(0, [0.1, 0.3, 0.6], 3, 0.6, 10), _record(1, [0.2, 0.3], 2, 0.4, 20),
           _record(2, [0.5], 1, 0.5, 30), _record(3, [], 0, 0.05, 40, success=False)]


def test_summarize_hand_computed():
    s = summarize(RECORDS, duration=2.0, percentiles=(50, 90, 99))
    approx = pytest.approx
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 6)
    assert s["request_throughput"] == approx(1.5)
    assert s["output_throughput"] == approx(3.0)
    assert s["total_token_throughput"] == approx(33.0)
    assert s["request_goodput"] is None
    # TTFT [100, 200, 500]: linear interpolation, p90 at rank 1.8 -> 200 + 0.8 * 300
    assert s["mean_ttft_ms"] == approx(800 / 3)
    assert s["median_ttft_ms"] == approx(200) and s["p50_ttft_ms"] == approx(200)
    assert s["p90_ttft_ms"] == approx(440) and s["p99_ttft_ms"] == approx(494)
    assert s["std_ttft_ms"] == approx(statistics.pstdev([100, 200, 500]))
    # TPOT [250, 200]
    assert s["mean_tpot_ms"] == approx(225) and s["median_tpot_ms"] == approx(225)
    assert s["p90_tpot_ms"] == approx(245)
    # ITL [200, 300, 100]
    assert s["mean_itl_ms"] == approx(200) and s["median_itl_ms"] == approx(200)
    assert s["p99_itl_ms"] == approx(298)
    # E2E [600, 400, 500]
    assert s["mean_e2el_ms"] == approx(500) and s["median_e2el_ms"] == approx(500)
    assert s["p90_e2el_ms"] == approx(580)


def test_goodput_hand_computed():
    # ttft <= 250 and tpot <= 240: A fails on TPOT, B passes, C fails on TTFT -> 1 good request in 2 s
    s = summarize(RECORDS, 2.0, {"ttft": 250, "tpot": 240})
    assert s["good_requests"] == 1 and s["request_goodput"] == pytest.approx(0.5)
    # e2el <= 500: B and C (C has no TPOT and counts as 0, as in vLLM)
    s = summarize(RECORDS, 2.0, {"e2el": 500, "tpot": 0})
    assert s["good_requests"] == 1  # only C: B's TPOT is 200 > 0
    s = summarize(RECORDS, 2.0, {"e2el": 500})
    assert s["good_requests"] == 2 and s["request_goodput"] == pytest.approx(1.0)


def test_summarize_without_samples_and_bad_input():
    s = summarize([_record(0, [0.1], 1, 0.1, 5)], 1.0, percentiles=(99.9,))
    assert s["mean_tpot_ms"] is None and s["p99.9_tpot_ms"] is None and s["mean_itl_ms"] is None
    assert s["p99.9_ttft_ms"] == pytest.approx(100)
    with pytest.raises(ValueError, match="duration"):
        summarize(RECORDS, 0.0)
    with pytest.raises(ValueError, match="ttft, tpot, e2el"):
        parse_goodput(["latency:5"])
    assert parse_goodput(["ttft:500", "e2el:2.5"]) == {"ttft": 500.0, "e2el": 2.5}
    assert parse_percentiles("50,99.9") == (50.0, 99.9)
    with pytest.raises(ValueError):
        parse_percentiles("50,101")


def _five_sigma_rel(n: int, burstiness: float) -> float:
    """Five standard errors of the sample variance of n gamma draws, relative (excess kurtosis 6/B)."""
    return 5 * math.sqrt((2 + 6 / burstiness) / n)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_mean_and_variance(burstiness):
    rate, n = 4.0, 20_000
    times = arrival_times(n + 1, rate, burstiness, seed=7)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean, var = statistics.fmean(gaps), statistics.variance(gaps)
    # gamma with shape B and scale 1 / (R B): mean 1 / R, variance 1 / (R^2 B)
    expected_var = 1 / (rate**2 * burstiness)
    assert abs(mean - 1 / rate) < 5 * math.sqrt(expected_var / n)
    assert abs(var / expected_var - 1) < _five_sigma_rel(n, burstiness)


def test_arrivals_are_seeded_and_inf_is_all_at_once():
    assert arrival_times(50, 2.0, 1.0, seed=3) == arrival_times(50, 2.0, 1.0, seed=3)
    assert arrival_times(50, 2.0, 1.0, seed=3) != arrival_times(50, 2.0, 1.0, seed=4)
    assert arrival_times(5, math.inf, 1.0, seed=0) == (0.0,) * 5
    with pytest.raises(ValueError, match="rate"):
        arrival_times(5, 0.0, 1.0, seed=0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(5, 1.0, 0.0, seed=0)


def test_phases_switch_rates_at_the_boundaries():
    phases = parse_phases("2:200, 20:50,0:30,5:100")
    assert phases == (Phase(2, 200), Phase(20, 50), Phase(0, 30), Phase(5, 100))
    times = phased_arrival_times(phases, 1.0, seed=1)
    assert all(b >= a for a, b in zip(times, times[1:]))
    start = 0.0
    for phase in phases:
        inside = [t for t in times if start <= t < start + phase.duration_s]
        expected = phase.rate * phase.duration_s
        assert abs(len(inside) - expected) <= 5 * math.sqrt(max(expected, 1)), (phase, len(inside))
        start += phase.duration_s
    assert max(times) < start
    assert phased_arrival_times(phases, 1.0, seed=1) == times
    for bad in ("2", "x:3", "2:0", "-1:5", "inf:5"):
        with pytest.raises(ValueError, match="rate:seconds"):
            parse_phases(bad)


def test_datasets():
    reqs = random_requests(200, 100, 20, 0.5, seed=0)
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in reqs)
    assert all(len(r.prompt.split()) == r.prompt_len for r in reqs)
    assert random_requests(5, 10, 4, 0.0, seed=1) == random_requests(5, 10, 4, 0.0, seed=1)
    assert {r.output_len for r in random_requests(5, 10, 4, 0.0, seed=1)} == {4}
    shared = shared_prefix_requests(12, 3, 40, 6, 8, seed=0)
    assert len({r.system for r in shared}) == 3 and len({r.prompt for r in shared}) == 12
    assert shared[0].messages()[0]["role"] == "system" and shared[0].completion_prompt().startswith(shared[0].system)
    assert len(load_instructions()) >= 40
    inst = instruction_requests(50, 16, seed=0)
    assert len(inst) == 50 and len({r.prompt for r in inst}) >= 40 and inst[0].messages()[0]["role"] == "user"
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(1, 10, 10, 1.0, seed=0)


# ---------------------------------------------------------------- fake server

class FakeServer:
    """An OpenAI-shaped server: streams ``max_tokens`` tokens, two per chunk, then a usage chunk
    (none if the prompt says NOUSAGE); answers 400 to a prompt containing BAD."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.auth: set[str | None] = set()
        self.in_flight = self.max_in_flight = 0
        self.loop = asyncio.new_event_loop()
        self.url = ""

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def complete(self, request):
        body = await request.json()
        self.bodies.append(body)
        self.auth.add(request.headers.get("Authorization"))
        chat = request.path.endswith("/chat/completions")
        text = " ".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        if "BAD" in text:
            return web.json_response({"error": {"message": "bad prompt", "type": "BadRequestError"}}, status=400)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj):
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        n = body["max_tokens"]
        if chat:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(0, n, 2):
            piece = "".join(f" t{j}" for j in range(i, min(n, i + 2)))
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            await send({"choices": [choice]})
            await asyncio.sleep(0.002)
        if "NOUSAGE" not in text:
            await send({"choices": [], "usage": {"prompt_tokens": len(text.split()), "completion_tokens": n,
                                                 "total_tokens": len(text.split()) + n}})
        await resp.write(b"data: [DONE]\n\n")
        self.in_flight -= 1
        return resp

    def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        self.runner = web.AppRunner(app)
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        ready.wait(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture
def fake():
    server = FakeServer()
    server.start()
    yield server
    server.stop()


def _check_times(record):
    assert record.start_s >= 0 and record.e2e_s >= 0
    assert 0 <= record.ttft_s <= record.e2e_s
    assert list(record.chunk_times_s) == sorted(record.chunk_times_s) and record.chunk_times_s[-1] <= record.e2e_s


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_end_to_end_both_endpoints(fake, endpoint):
    options = ServeBenchOptions(url=fake.url, endpoint=endpoint, dataset="random", num_prompts=6,
                                random_input_len=8, random_output_len=5, random_range_ratio=0.5,
                                request_rate=200.0, ignore_eos=True, max_concurrency=2, show_progress=False)
    result = asyncio.run(run_serve_benchmark(options))
    assert result.model == "fake-model"
    assert result.summary["completed"] == 6 and result.summary["failed"] == 0
    assert len(fake.bodies) == 6 and fake.max_in_flight <= 2
    for body in fake.bodies:
        assert body["model"] == "fake-model" and body["stream"] and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0
        assert ("messages" in body) == (endpoint == "chat") and ("prompt" in body) == (endpoint == "completions")
    for record in result.records:
        assert record.success and record.output_tokens_source == "usage"
        assert record.output_tokens == record.output_len  # usage, not the (halved) chunk count
        assert len(record.chunk_times_s) == math.ceil(record.output_len / 2)
        assert record.prompt_tokens == record.prompt_len  # the fake counts words
        _check_times(record)
    assert result.summary["total_output_tokens"] == sum(r.output_len for r in result.records)
    assert sorted(r.index for r in result.records) == list(range(6))


def test_http_400_counts_as_failed_and_usage_fallback(fake):
    requests = (BenchRequest("hello there", 4, 2), BenchRequest("a BAD one", 4, 3),
                BenchRequest("NOUSAGE please", 5, 2))
    options = ServeBenchOptions(url=fake.url + "/v1/", model="m", num_prompts=6, requests=requests,
                                show_progress=False, goodput={"e2el": 60_000}, api_key="sk-test")
    result = asyncio.run(run_serve_benchmark(options))
    assert (result.summary["completed"], result.summary["failed"]) == (4, 2)
    bad = [r for r in result.records if not r.success]
    assert {r.index for r in bad} == {1, 4} and all(r.error.startswith("HTTP 400") for r in bad)
    fallback = [r for r in result.records if r.index in (2, 5)]
    assert all(r.output_tokens_source == "chunks" and r.output_tokens == 3 for r in fallback)  # 5 tokens, 3 chunks
    assert result.summary["total_output_tokens"] == 4 + 4 + 3 + 3
    assert result.summary["good_requests"] == 4
    assert all(b["model"] == "m" for b in fake.bodies)
    assert fake.auth == {"Bearer sk-test"} and result.to_json()["config"]["api_key"] == "<redacted>"


def test_cli_writes_json_and_plots(fake, tmp_path, capsys):
    out, plots = tmp_path / "serve.json", tmp_path / "plots"
    code = main(["bench", "serve", "--url", fake.url, "--endpoint", "chat", "--dataset", "shared-prefix",
                 "--num-prompts", "5", "--num-prefixes", "2", "--prefix-len", "20", "--output-len", "3",
                 "--goodput", "ttft:60000", "--metric-percentiles", "50,99", "--disable-tqdm",
                 "--json", str(out), "--plots", str(plots)])
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result) == {"model", "config", "summary", "requests", "run"}
    run = result["run"]
    assert run["benchmark"] == "serve" and run["argv"][:3] == ["tandem", "bench", "serve"]
    assert run["machine"]["cores_available"] >= 1 and run["machine"]["cpu_kind"]
    assert {"wall_s", "load_average_start", "load_average_end", "code"} <= set(run)
    summary = result["summary"]
    for key in ("completed", "failed", "duration_s", "request_throughput", "output_throughput",
                "total_token_throughput", "request_goodput", "mean_ttft_ms", "median_tpot_ms", "p99_itl_ms",
                "p50_e2el_ms"):
        assert key in summary
    assert summary["completed"] == 5 and summary["total_output_tokens"] == 15 and summary["good_requests"] == 5
    assert result["config"]["dataset"] == "shared-prefix" and result["config"]["request_rate"] == "inf"
    assert len(result["requests"]) == 5 and all(r["ttft_s"] <= r["e2e_s"] for r in result["requests"])
    assert {p.name for p in plots.iterdir()} == {"latency_cdf.png", "throughput.png"}
    printed = capsys.readouterr().out
    assert "TTFT" in printed

    # the saved result alone prints the same tables and draws the same figures again
    again = tmp_path / "again"
    assert main(["bench", "show", str(out), "--plots", str(again)]) == 0
    shown = capsys.readouterr().out
    assert shown.split("wrote")[0] == printed.split("wrote")[0]
    assert {p.name for p in again.iterdir()} == {"latency_cdf.png", "throughput.png"}


def test_show_refuses_a_file_that_is_no_benchmark_result(tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"summary": {}}))
    assert main(["bench", "show", str(other)]) != 0
    assert "names no known benchmark" in capsys.readouterr().err
    assert main(["bench", "show", str(tmp_path / "missing.json")]) != 0
    assert "cannot read" in capsys.readouterr().err


def test_cli_rejects_bad_phases(capsys):
    assert main(["bench", "serve", "--phases", "fast:10", "--disable-tqdm"]) == 2
    assert "rate:seconds" in capsys.readouterr().err
