"""ProcessBackend: Tandem's engine in its engine-core process, seen from the replica.

The same tokens as the in-process engine, errors as error deltas, closing a stream frees
its blocks in the core, metrics and the step timeline cross over, and a core that dies
fails the requests in flight with a 503 and the health check.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from cluster.config import config_from_dict
from cluster.engine.backend import BackendContext, EngineUnhealthyError
from cluster.engine.llm import LLM
from cluster.engine.process_backend import ProcessBackend
from cluster.engine.protocol import GenerateDelta, GenerateRequest, merge_deltas
from cluster.shared.sampling_params import SamplingParams
from cluster.metrics.collector import MemorySink
from tests.engine_helpers import close_after_tokens

GREEDY = dict(temperature=0, ignore_eos=True)


def _config(model_dir):
    return config_from_dict({
        "model": {"model": str(model_dir), "max_model_len": 256},
        "cache": {"num_blocks": 64, "block_size": 16},
        "device": {"device": "cpu", "num_threads": 1},
    }, "test config")


def _start(model_dir) -> tuple[ProcessBackend, MemorySink]:
    config = _config(model_dir)
    sink = MemorySink()
    return ProcessBackend(config, config.serve.groups[0], BackendContext(metrics_sink=sink)), sink


@pytest.fixture(scope="module")
def backend(tiny_llama_dir):
    backend, sink = _start(tiny_llama_dir)
    backend.test_sink = sink
    yield backend
    asyncio.run(backend.shutdown())


async def _collect(backend, request) -> list[GenerateDelta]:
    return [delta async for delta in backend.generate(request)]


def test_streams_the_in_process_engines_tokens(backend, tiny_llama_dir):
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
    backend, _ = _start(tiny_llama_dir)
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
    from cluster.engine.core_messages import AddRequest
    from cluster.engine.engine import Engine
    from cluster.engine.engine_core import EngineCore

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
