"""The engine core seen from the replica, through both clients: ``ProcessClient`` (the core in
a process of its own) and ``InprocClient`` (in a thread of the replica's process).

Each gives the offline engine's tokens, errors as error deltas (400 bad input, 429 a full
queue), closing or cancelling a stream frees its blocks in the core, metrics and the step
timeline cross over; a core that dies fails the requests in flight with a 503 and the
health check, and a failed step fails them with a 500 and marks the core.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from cluster.config import config_from_dict
from cluster.config import with_overrides
from cluster.engine.engine import Engine
from cluster.engine.llm import LLM
from cluster.hosting.backend import BackendContext, EngineUnhealthyError
from cluster.hosting.inproc_client import InprocClient
from cluster.hosting.process_client import ProcessClient
from cluster.hosting.protocol import GenerateDelta, GenerateRequest, merge_deltas
from cluster.metrics.collector import MemorySink
from cluster.shared.sampling_params import SamplingParams
from tests.engine_helpers import close_after_tokens

GREEDY = dict(temperature=0, ignore_eos=True)


def _config(model_dir, **overrides):
    config = config_from_dict({
        "model": {"model": str(model_dir), "max_model_len": 256},
        "cache": {"num_blocks": 64, "block_size": 16},
        "device": {"device": "cpu", "num_threads": 1},
    }, "test config")
    return with_overrides(config, **overrides) if overrides else config


def _start(kind: str, model_dir, **overrides):
    config = _config(model_dir, **overrides)
    sink = MemorySink()
    if kind == "process":
        return ProcessClient(config, config.serve.groups[0], BackendContext(metrics_sink=sink)), sink
    return InprocClient(Engine(config), metrics_sink=sink), sink


@pytest.fixture(scope="module", params=["process", "inproc"])
def backend(request, tiny_llama_dir):
    backend, sink = _start(request.param, tiny_llama_dir)
    backend.test_sink = sink
    yield backend
    asyncio.run(backend.shutdown())


async def _collect(backend, request) -> list[GenerateDelta]:
    return [delta async for delta in backend.generate(request)]


def test_streams_the_offline_engines_tokens(backend, tiny_llama_dir):
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46]]
    params = SamplingParams(max_tokens=12, **GREEDY)
    expected = LLM(str(tiny_llama_dir), device="cpu", num_blocks=64).generate(prompts, params)

    async def run():
        requests = [GenerateRequest(f"same-{i}", p, params) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(_collect(backend, r) for r in requests))

    for deltas, want in zip(asyncio.run(run()), expected):
        assert deltas[0].accepted and not deltas[0].token_ids
        assert [t for d in deltas[1:] for t in d.token_ids] == want.outputs[0].token_ids
        assert deltas[-1].finish_reason == "length" and not any(d.finished for d in deltas[:-1])


def test_bad_input_comes_back_as_a_400_delta(backend):
    request = GenerateRequest("bad", [1, 10**6], SamplingParams(max_tokens=4))
    deltas = asyncio.run(_collect(backend, request))
    assert len(deltas) == 1 and deltas[0].error is not None
    assert deltas[0].error.status == 400 and "prompt token ids" in deltas[0].error.message


def test_closing_a_stream_early_frees_its_blocks(backend):
    request = GenerateRequest("early", list(range(3, 40)), SamplingParams(max_tokens=200, **GREEDY))
    stats = asyncio.run(close_after_tokens(backend, request))
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_metrics_and_the_step_timeline_cross_over(backend):
    asyncio.run(_collect(backend, GenerateRequest("counted", [3, 4, 5], SamplingParams(max_tokens=6, **GREEDY))))
    deadline = time.monotonic() + 10
    while backend.test_sink.counter("generation_tokens") < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.test_sink.counter("generation_tokens") >= 6
    timeline = asyncio.run(backend.step_timeline())
    summary = timeline["summary"]
    assert summary["num_steps"] >= 6 and summary["mean_output_tokens_per_step"] >= 1
    assert 0 < summary["busy_fraction"] <= 1.0
    assert 6 <= asyncio.run(backend.step_timeline(60.0))["summary"]["num_steps"] <= summary["num_steps"]
    time.sleep(0.5)  # the core waits: the last 0.2 s hold none of the steps
    assert asyncio.run(backend.step_timeline(0.2))["summary"] == {"num_steps": 0}
    assert backend.load(8).num_running == 0 and backend.load(8).block_size == 16


def test_a_dead_core_fails_requests_with_503_and_the_health_check(tiny_llama_dir):
    backend, _ = _start("process", tiny_llama_dir)
    backend.check_health()

    async def run():
        request = GenerateRequest("doomed", [3, 4, 5], SamplingParams(max_tokens=240, **GREEDY))
        deltas = []
        async for delta in backend.generate(request):
            deltas.append(delta)
            if len(deltas) == 2:
                os.kill(backend.core_pid, signal.SIGKILL)
        return deltas

    # The stream must end, not hang: a bound, not a measurement (wait_for raises past it).
    deltas = asyncio.run(asyncio.wait_for(run(), timeout=30))
    assert deltas[-1].error is not None and deltas[-1].error.status == 503, deltas[-1]
    with pytest.raises(EngineUnhealthyError, match="exited"):
        backend.check_health()
    after = asyncio.run(_collect(backend, GenerateRequest("late", [3], SamplingParams(max_tokens=2))))
    assert len(after) == 1 and after[0].error.status == 503
    asyncio.run(backend.shutdown())


def test_merged_deltas_join_text_tokens_and_logprobs():
    first = GenerateDelta(text="a", token_ids=[1], logprobs=[{1: None}], num_output_tokens=1)
    second = GenerateDelta(text="b", token_ids=[2, 3], finish_reason="length", num_output_tokens=3)
    merged = merge_deltas(first, second)
    assert (merged.text, merged.token_ids, merged.finish_reason, merged.num_output_tokens) == ("ab", [1, 2, 3],
                                                                                             "length", 3)
    assert merged.logprobs == [{1: None}]
    # The prompt's logprobs come with a stream's first token delta: a merge keeps them.
    first.prompt_logprobs = [None, {5: None}]
    assert merge_deltas(first, second).prompt_logprobs == [None, {5: None}]
    assert merge_deltas(second, first).prompt_logprobs == [None, {5: None}]


def test_a_failed_step_fails_the_requests_in_flight_with_500_and_marks_the_core(tiny_llama_dir, monkeypatch):
    from cluster.hosting.core import EngineCore
    from cluster.hosting.core_messages import AddRequest

    engine = Engine(_config(tiny_llama_dir))
    core = EngineCore(engine)
    core.handle(AddRequest(GenerateRequest("victim", [3, 4, 5], SamplingParams(max_tokens=8, **GREEDY))))
    assert core.step()

    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "step", broken_step)
    assert not core.step()
    message = core.take_message(time.monotonic(), force_snapshot=True)
    errors = [d.error for rid, d in message.deltas if rid == "victim" and d.error is not None]
    assert errors and errors[0].status == 500 and "device lost" in errors[0].message
    assert "device lost" in message.snapshot.failed
    assert not engine.has_unfinished() and engine.block_manager.pool.num_free_blocks == 64


def test_concurrent_requests_all_finish(backend):
    async def one(i):
        request = GenerateRequest(f"many-{i}", [3 + i, 4, 5], SamplingParams(max_tokens=4 + i, **GREEDY))
        return sum(len(d.token_ids) for d in await _collect(backend, request))

    async def run():
        return await asyncio.gather(*(one(i) for i in range(8)))

    assert asyncio.run(run()) == [4 + i for i in range(8)]
    stats = asyncio.run(backend.engine_stats())
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_a_cancelled_consumer_aborts_its_request(backend):
    async def run():
        streaming = asyncio.Event()

        async def consume():
            request = GenerateRequest("cancel-me", [3, 4, 5], SamplingParams(max_tokens=200, **GREEDY))
            async for delta in backend.generate(request):
                if delta.token_ids:
                    streaming.set()

        task = asyncio.create_task(consume())
        await streaming.wait()  # cancelled mid-stream
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        done = await _collect(backend, GenerateRequest("after", [7, 8], SamplingParams(max_tokens=2, **GREEDY)))
        return done, await backend.engine_stats()

    done, stats = asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert done[-1].finish_reason == "length"
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("kind", ["process", "inproc"])
def test_a_full_queue_answers_429_and_accepts_again_once_it_drains(kind, tiny_llama_dir):
    # One sequence runs at a time, so every other request waits; two may wait.
    backend, _ = _start(kind, tiny_llama_dir, max_num_seqs=1, max_queued_requests=2)
    long = SamplingParams(max_tokens=240, **GREEDY)

    async def run():
        streams = {rid: backend.generate(GenerateRequest(rid, [3 + i, 4, 5], long)) for i, rid in enumerate("abc")}
        for stream in streams.values():  # each acknowledged: queued in the core, in order
            assert (await stream.__anext__()).accepted
        rest = {rid: asyncio.create_task(_collect_stream(stream)) for rid, stream in streams.items()}
        refused = await _collect(backend, GenerateRequest("d", [8, 9], long))  # "a" runs, "b" and "c" wait
        outputs = [await task for task in rest.values()]
        again = await _collect(backend, GenerateRequest("d", [8, 9], SamplingParams(max_tokens=3, **GREEDY)))
        return refused, outputs, again, await backend.engine_stats()

    try:
        refused, outputs, again, stats = asyncio.run(asyncio.wait_for(run(), timeout=120))
    finally:
        asyncio.run(backend.shutdown())
    assert len(refused) == 1 and refused[0].error.status == 429
    assert "max_queued_requests=2" in refused[0].error.message
    for deltas in outputs:
        assert sum(len(d.token_ids) for d in deltas) == 240 and deltas[-1].finish_reason == "length"
    assert again[-1].finish_reason == "length"  # the refused id was never taken
    assert stats["num_free_blocks"] == stats["num_blocks"]


async def _collect_stream(stream) -> list[GenerateDelta]:
    return [delta async for delta in stream]
