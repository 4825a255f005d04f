"""scheduler.policy priority on a vLLM group: Tandem's ``VllmBackend`` sets vLLM's
``scheduling_policy`` and hands each request's priority to ``generate``, so requests that wait
behind a running one are served lower priority first, as the native engine serves them
(tests/unit/test_priority_scheduling.py); a group that schedules first come, first served
refuses a priority before vLLM sees it, with the native engine's message."""

from __future__ import annotations

import asyncio

from cluster.config import config_from_dict
from cluster.hosting.backend import BackendContext
from cluster.hosting.protocol import GenerateRequest
from cluster.shared.sampling_params import SamplingParams


def _backend(policy: str):
    from cluster.backends.vllm import VllmBackend

    config = config_from_dict({
        "model": {"model": "smollm2-135m-instruct", "dtype": "float32", "max_model_len": 256},
        "cache": {"kv_cache_memory": "64MiB"}, "scheduler": {"max_num_seqs": 1, "policy": policy},
        "device": {"device": "cpu", "num_threads": 1},
        "engine": {"backend": "vllm", "vllm_args": {"enforce_eager": True}},
        "serve": {"groups": [{"name": "vllm", "engine": "vllm"}]},
    })
    return VllmBackend(config, config.serve.groups[0], BackendContext())


def _params(priority: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, priority=priority)


def test_waiting_requests_are_served_by_priority_on_a_vllm_group():
    async def run() -> list[str]:
        backend = _backend("priority")
        finished: list[str] = []
        try:
            async def one(name: str, priority: int, max_tokens: int, started: asyncio.Event | None = None):
                async for delta in backend.generate(GenerateRequest(name, [1, 2, 3, 4], _params(priority, max_tokens))):
                    assert delta.error is None, delta.error
                    if started is not None and delta.token_ids:
                        started.set()
                finished.append(name)

            started = asyncio.Event()
            blocker = asyncio.create_task(one("blocker", 0, 48, started))
            await started.wait()  # it runs alone (max_num_seqs 1); the others wait behind it
            await asyncio.gather(one("low", 5, 2), one("middle", 0, 2), one("high", -1, 2), blocker)
            return finished
        finally:
            await backend.shutdown()

    assert asyncio.run(run()) == ["blocker", "high", "middle", "low"]


def test_a_first_come_first_served_vllm_group_refuses_a_priority():
    async def run():
        backend = _backend("fcfs")
        try:
            return [d async for d in backend.generate(GenerateRequest("r", [1, 2, 3], _params(3, 2)))]
        finally:
            await backend.shutdown()

    deltas = asyncio.run(run())
    assert deltas[0].error.status == 400 and deltas[0].error.param == "priority"
    assert "scheduler.policy: priority" in deltas[0].error.message
