"""LoRA adapters on both engines, on the embedded default model: a PEFT adapter served by Tandem's
native engine and by a vLLM group (Tandem's ``VllmBackend``, which hands vLLM a ``LoRARequest``)
gives PEFT's own greedy tokens on each, and base-model requests keep theirs (in the native engine
in the same batch; in vLLM's CPU build only in a batch of their own, see docs/lora.md)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cluster.config import config_from_dict
from cluster.hosting.backend import BackendContext
from cluster.engine.llm import LLM
from cluster.hosting.protocol import GenerateRequest
from cluster.models.loader import load_tokenizer, resolve_model
from cluster.shared.sampling_params import SamplingParams
from tests.lora_helpers import peft_model, reference_greedy, save_peft_adapter

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = resolve_model("smollm2-135m-instruct").path
    adapter = save_peft_adapter(path, tmp_path_factory.mktemp("smollm2_lora"), seed=3, rank=8, alpha=16)
    ids = [load_tokenizer(resolve_model("smollm2-135m-instruct"))(p)["input_ids"] for p in PROMPTS]

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = {"lora": reference_greedy(peft_model(path, adapter), ids, MAX_TOKENS),
                None: reference_greedy(base, ids, MAX_TOKENS)}
    assert expected["lora"] != expected[None]
    return path, adapter, ids, expected


def test_the_native_engine_gives_pefts_tokens(setup):
    path, adapter, ids, expected = setup
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=64, lora_modules={"lora": str(adapter)})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(ids * 2, params, lora=["lora"] * len(ids) + [None] * len(ids))
    assert [o.outputs[0].token_ids for o in outs] == expected["lora"] + expected[None]


def test_a_vllm_group_gives_pefts_tokens(setup):
    from cluster.backends.vllm import VllmBackend

    path, adapter, ids, expected = setup
    config = config_from_dict({
        "model": {"model": str(path), "dtype": "float32", "max_model_len": 256,
                  "lora_modules": {"lora": str(adapter)}, "max_lora_rank": 8},
        "cache": {"kv_cache_memory": "64MiB"}, "device": {"device": "cpu", "num_threads": 1},
        "engine": {"backend": "vllm", "vllm_args": {"enforce_eager": True}},
        "serve": {"groups": [{"name": "vllm", "engine": "vllm"}]},
    })

    async def run() -> list[list[int]]:
        backend = VllmBackend(config, config.serve.groups[0], BackendContext())
        try:
            async def one(index: int, prompt: list[int], lora: str | None) -> list[int]:
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
                tokens = []
                async for delta in backend.generate(GenerateRequest(f"r{index}", prompt, params, lora=lora)):
                    assert delta.error is None, delta.error
                    tokens += delta.token_ids
                return tokens

            # Adapter and base requests in separate batches: vLLM 0.32's CPU build gives a request without
            # an adapter the adapter's update when both are in one batch (docs/lora.md).
            results = await asyncio.gather(*(one(i, p, "lora") for i, p in enumerate(ids)))
            results += await asyncio.gather(*(one(10 + i, p, None) for i, p in enumerate(ids)))
            refused = [d async for d in backend.generate(GenerateRequest("x", ids[0], SamplingParams(), lora="other"))]
            assert refused[0].error.status == 400 and refused[0].error.param == "model"
            return results
        finally:
            await backend.shutdown()

    assert asyncio.run(run()) == expected["lora"] + expected[None]


def test_a_vllm_group_loads_adapters_from_its_lora_dir(setup, tmp_path):
    """``model.lora_dir`` on a vLLM group: an adapter folder named by a request is handed to vLLM and
    gives PEFT's tokens; a folder that is not there is a 404 and one vLLM cannot load a 400, and the
    engine serves on. The replica publishes the adapter vLLM holds (room for one)."""
    import shutil

    from cluster.backends.vllm import VllmBackend

    path, adapter, ids, expected = setup
    shutil.copytree(adapter, tmp_path / "mine")
    shutil.copytree(adapter, tmp_path / "other")
    shutil.copytree(adapter, tmp_path / "broken")
    (tmp_path / "broken" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    config = config_from_dict({
        "model": {"model": str(path), "dtype": "float32", "max_model_len": 256, "lora_dir": str(tmp_path),
                  "max_loras": 1, "max_lora_rank": 8},
        "cache": {"kv_cache_memory": "64MiB"}, "device": {"device": "cpu", "num_threads": 1},
        "engine": {"backend": "vllm", "vllm_args": {"enforce_eager": True}},
        "serve": {"groups": [{"name": "vllm", "engine": "vllm"}]},
    })
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

    async def run():
        backend = VllmBackend(config, config.serve.groups[0], BackendContext())
        try:
            async def one(rid: str, prompt: list[int], lora: str | None):
                return [d async for d in backend.generate(GenerateRequest(rid, prompt, params, lora=lora))]

            missing, broken = await one("m", ids[0], "missing"), await one("b", ids[0], "broken")
            served = await asyncio.gather(*(one(f"r{i}", p, "mine") for i, p in enumerate(ids)))
            holding_mine = backend.load(0)
            await one("o", ids[0], "other")
            return missing, broken, served, holding_mine, backend.load(0)
        finally:
            await backend.shutdown()

    missing, broken, served, holding_mine, holding_other = asyncio.run(run())
    # What the router reads: the adapter vLLM holds, and what handing it to vLLM took.
    assert holding_mine.lora_adapters == {"mine"} and holding_mine.lora_load_seconds > 0
    assert holding_other.lora_adapters == {"other"}
    assert (missing[0].error.status, missing[0].error.code) == (404, "model_not_found")
    assert broken[0].error.status == 400 and "'broken' cannot be loaded" in broken[0].error.message
    assert [[t for d in deltas for t in d.token_ids] for deltas in served] == expected["lora"]
