"""The batch-size -> k table a vLLM group installs means, in vLLM's own reading of it (its dense
lookup, ``build_dynamic_sd_schedule_lookup``), the k Tandem's table controller picks at every
batch size: one profile, one k per batch size, whichever engine runs it."""

from __future__ import annotations

import pytest

from cluster.spec_decode.controller import BatchState, TableController
from cluster.spec_decode.profile_data import batch_size_ranges


@pytest.mark.parametrize("table", [{1: 4, 4: 3, 16: 1}, {8: 2}, {2: 5, 3: 4, 64: 0}, {1: 6, 32: 2}])
def test_vllm_reads_the_ranges_as_the_native_table(table):
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    max_batch, max_k = 96, max(table.values()) or 1
    lookup = build_dynamic_sd_schedule_lookup(batch_size_ranges(table), max_batch, max_k)
    native = TableController(table)
    assert [lookup[b] for b in range(1, max_batch + 1)] == [
        min(max_k, native.choose_k(BatchState(b, 0))) for b in range(1, max_batch + 1)]


def _adaptive_backend():
    from cluster.backends.vllm import VllmBackend
    from cluster.config import config_from_dict
    from cluster.hosting.backend import BackendContext

    config = config_from_dict({
        "model": {"model": "smollm2-135m-instruct", "dtype": "float32", "max_model_len": 256},
        "cache": {"kv_cache_memory": "64MiB"}, "scheduler": {"max_num_seqs": 8},
        "device": {"device": "cpu", "num_threads": 1},
        "speculative": {"method": "ngram", "num_speculative_tokens": 4, "controller": "adaptive",
                        "profile": "configs/profiles/cpu-1thread-smollm2-135m-ngram-f32-vllm.json"},
        "engine": {"backend": "vllm", "vllm_args": {"enforce_eager": True}},
        "serve": {"groups": [{"name": "vllm", "engine": "vllm"}]},
    })
    return VllmBackend(config, config.serve.groups[0], BackendContext())


def test_an_adaptive_vllm_group_drafts_as_many_tokens_as_the_schedule_its_replica_writes():
    """The file says k = 1, then k = 3 at every batch size: vLLM's own counters show drafts at the
    second position only under the second (the controller's own rewrites held off meanwhile)."""
    import asyncio
    import time

    from cluster.backends.vllm_k_schedule import READ_EVERY_S
    from cluster.hosting.protocol import GenerateRequest
    from cluster.shared.sampling_params import SamplingParams

    prompt = [1] + [504, 2137, 314, 6611, 28] * 8  # n-gram lookup finds the pattern again and again

    async def drafted_per_position(backend, name: str) -> list[int]:
        before = list(backend.recorder.spec.drafted_per_position)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        async for delta in backend.generate(GenerateRequest(name, prompt, params)):
            assert delta.error is None, delta.error
        after = backend.recorder.spec.drafted_per_position
        return [a - (before[j] if j < len(before) else 0) for j, a in enumerate(after)]

    async def run():
        backend = _adaptive_backend()
        try:
            assert backend.settings.spec.policy == "adaptive-table"
            assert backend.settings.engine_args["scheduler_cls"].endswith("following_scheduler")
            backend.recorder.on_step = None  # the replica's controller writes nothing during the check
            backend.online.file.write([[1, 8, 1]])
            time.sleep(2 * READ_EVERY_S)
            one = await drafted_per_position(backend, "k1")
            backend.online.file.write([[1, 8, 3]])
            time.sleep(2 * READ_EVERY_S)
            three = await drafted_per_position(backend, "k3")
            return one, three
        finally:
            await backend.shutdown()

    one, three = asyncio.run(run())
    assert one[0] > 0 and sum(one[1:]) == 0, one
    assert three[0] > 0 and three[1] > 0 and three[2] > 0 and sum(three[3:]) == 0, three
