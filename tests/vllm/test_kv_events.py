"""A vLLM group publishes its cached prefixes as the router names them: after a request, its
replica's load carries the names the ingress computes for that prompt's full blocks (read from
vLLM's own KV events), so prefix affinity reaches vLLM replicas."""

from __future__ import annotations

import asyncio
import time

from cluster.config import config_from_dict
from cluster.hosting.backend import BackendContext
from cluster.hosting.protocol import GenerateRequest
from cluster.kv.prefix_cache import engine_hash_seed
from cluster.routing.prefix_hashes import leading_block_hashes
from cluster.shared.sampling_params import SamplingParams


def test_a_vllm_replica_publishes_the_names_of_the_prompts_it_cached():
    from cluster.backends.vllm import VllmBackend

    config = config_from_dict({
        "model": {"model": "smollm2-135m-instruct", "dtype": "float32", "max_model_len": 1024},
        "cache": {"kv_cache_memory": "64MiB", "block_size": 16}, "scheduler": {"max_num_seqs": 4},
        "device": {"device": "cpu", "num_threads": 1},
        "engine": {"backend": "vllm", "vllm_args": {"enforce_eager": True}},
        "serve": {"groups": [{"name": "vllm", "engine": "vllm"}]},
    })
    prompt = list(range(1000, 1400))  # 25 of the group's blocks (vLLM on the CPU keeps 128-token ones: 3)
    expected = set(leading_block_hashes(prompt, 16, engine_hash_seed(config.model.model, config.model.dtype,
                                                                        config.model.seed), 8))

    async def run():
        backend = VllmBackend(config, config.serve.groups[0], BackendContext())
        try:
            assert backend.load(8).cached_prefix_hashes == frozenset()
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            async for delta in backend.generate(GenerateRequest("r", prompt, params)):
                assert delta.error is None, delta.error
            deadline = time.monotonic() + 30
            while not expected <= backend.load(8).cached_prefix_hashes and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert backend.load(8).block_size == 16  # the unit of the names, whatever vLLM's blocks are
            return (backend.load(8).cached_prefix_hashes, backend.load(2).cached_prefix_hashes,
                    (backend.kv_events.batches, backend.block_size, backend.kv_index.skipped))
        finally:
            await backend.shutdown()

    deep, shallow, seen = asyncio.run(run())
    assert seen[0] > 0, seen  # event batches read (vLLM's block size, blocks left unnamed)
    assert expected <= deep, (len(expected & deep), len(expected), seen)
    assert shallow == set(leading_block_hashes(prompt, 16, engine_hash_seed(
        config.model.model, config.model.dtype, config.model.seed), 2))
