"""Adapters served on demand from ``model.lora_dir``: loaded when a request first names one, at most
``max_loras`` at once (the least recently used idle one unloaded, its prefix-cache blocks forgotten),
a request waiting while every adapter is held, outputs equal to PEFT's throughout."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch

from cluster.config import TandemConfig, with_overrides
from cluster.hosting.backend import input_error
from cluster.hosting.core_messages import AbortRequest, AddRequest
from cluster.hosting.core import EngineCore
from cluster.hosting.engine_view import EngineView
from cluster.hosting.inproc_client import InprocClient
from cluster.engine.llm import LLM
from cluster.hosting.protocol import GenerateRequest
from cluster.errors import NotFoundError
from cluster.metrics.collector import EngineMetricsCollector, MemorySink
from cluster.models.lora import LoRAError
from cluster.routing.step_times import StepTimeTracker
from cluster.shared.sampling_params import SamplingParams
from tests.lora_helpers import peft_model, reference_greedy, save_peft_adapter

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_dir(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    save_peft_adapter(tiny_llama_dir, root / "all", seed=1)
    save_peft_adapter(tiny_llama_dir, root / "qv", seed=2, targets=["q_proj", "v_proj"], rank=8, alpha=16)
    (root / "not-an-adapter").mkdir()
    return root


@pytest.fixture(scope="module")
def references(tiny_llama_dir, lora_dir):
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (7, 33)]
    expected = {name: reference_greedy(peft_model(tiny_llama_dir, lora_dir / name), prompts, MAX_TOKENS)
                for name in ("all", "qv")}
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    expected[None] = reference_greedy(base, prompts, MAX_TOKENS)
    assert len({str(v) for v in expected.values()}) == 3  # each adapter changes the output
    return prompts, expected


def _llm(tiny_llama_dir, lora_dir, max_loras, num_blocks=128):
    return LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_blocks=num_blocks, lora_dir=str(lora_dir),
               max_loras=max_loras)


def _run(llm, prompts, names):
    outs = llm.generate([p for p in prompts for _ in names], GREEDY, lora=[n for _ in prompts for n in names])
    return [o.outputs[0].token_ids for o in outs]


def _expected(expected, prompts, names):
    return [expected[name][i] for i in range(len(prompts)) for name in names]


def test_adapters_load_on_demand_and_match_peft(tiny_llama_dir, lora_dir, references):
    prompts, expected = references
    llm = _llm(tiny_llama_dir, lora_dir, max_loras=4)
    assert llm.engine.adapters.loaded == []
    names = ["qv", None, "all"]
    assert _run(llm, prompts, names) == _expected(expected, prompts, names)
    assert sorted(llm.engine.adapters.loaded) == ["all", "qv"] and llm.engine.adapters.num_loads == 2
    llm.engine.check_invariants()
    # What the router reads: the adapters loaded and what a load took (routing/policy.py).
    load = EngineView(llm.engine, StepTimeTracker(), llm.engine.config).load(4)
    assert load.lora_adapters == {"all", "qv"} and load.lora_load_seconds > 0


def test_a_request_waits_while_every_adapter_is_held(tiny_llama_dir, lora_dir, references):
    """One adapter at a time: the qv requests wait behind the running all requests, then qv takes the
    slot once they finish; every output is PEFT's and every block comes back."""
    prompts, expected = references
    llm = _llm(tiny_llama_dir, lora_dir, max_loras=1)
    names = ["all", "qv", None]
    assert _run(llm, prompts, names) == _expected(expected, prompts, names)
    adapters = llm.engine.adapters
    assert (adapters.loaded, adapters.num_loads, adapters.num_unloads, adapters.waiting) == (["qv"], 2, 1, [])
    llm.engine.check_invariants()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.pool.num_blocks


def test_an_unloaded_adapters_cached_blocks_are_forgotten(tiny_llama_dir, lora_dir):
    prompt = list(range(3, 3 + 48))
    params = SamplingParams(max_tokens=2, temperature=0)
    for max_loras, cached_after_the_other in ((2, 32), (1, 0)):
        llm = _llm(tiny_llama_dir, lora_dir, max_loras=max_loras, num_blocks=64)
        llm.generate([prompt], params, lora="all")
        assert llm.generate([prompt], params, lora="all")[0].usage.cached_tokens == 32
        llm.generate([prompt], params, lora="qv")  # with one slot, unloads all
        assert llm.generate([prompt], params, lora="all")[0].usage.cached_tokens == cached_after_the_other
        assert llm.generate([prompt], params)[0].usage.cached_tokens == 0  # never another model's blocks


def test_a_waiting_request_can_be_aborted(tiny_llama_dir, lora_dir):
    engine = _llm(tiny_llama_dir, lora_dir, max_loras=1, num_blocks=32).engine
    engine.add_request([5, 6, 7], GREEDY, "held", lora="all")
    engine.add_request([5, 6, 7], GREEDY, "waiting", lora="qv")
    assert [r.request_id for r, _ in engine.adapters.waiting] == ["waiting"]
    assert engine.num_waiting == engine.stats().num_waiting == 2  # the router and metrics count it
    sink = MemorySink()
    EngineMetricsCollector(engine, sink).poll()
    assert {name: sink.gauges[(name, ())] for name in ("tandem_lora_adapters_loaded", "tandem_lora_requests_waiting",
                                                       "num_requests_waiting")} == {
        "tandem_lora_adapters_loaded": 1, "tandem_lora_requests_waiting": 1, "num_requests_waiting": 2}
    assert sink.counters[("tandem_lora_adapter_loads", ())] == 1
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5], GREEDY, "waiting")
    engine.step()
    engine.abort("waiting")
    assert engine.adapters.waiting == []
    while engine.has_unfinished():
        engine.step()
    assert engine.adapters.loaded == ["all"] and engine.adapters.num_loads == 1
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks


@pytest.mark.parametrize("name", ["missing", "not-an-adapter", "../qv", "qv/", ".hidden", ""])
def test_a_name_with_no_adapter_folder_is_not_found(tiny_llama_dir, lora_dir, name):
    llm = _llm(tiny_llama_dir, lora_dir, max_loras=2, num_blocks=16)
    with pytest.raises(NotFoundError, match="does not exist.*model.lora_dir") as caught:
        llm.generate([[5, 6]], GREEDY, lora=name)
    error = input_error(caught.value)
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")
    assert not llm.engine.has_unfinished()


def _broken_adapter(lora_dir, folder, how: str) -> None:
    """A copy of adapter ``all`` in ``folder``, broken as ``how`` says."""
    folder.mkdir()
    settings = json.loads((lora_dir / "all" / "adapter_config.json").read_text())
    weights = (lora_dir / "all" / "adapter_model.safetensors").read_bytes()
    config = {"dora": json.dumps({**settings, "use_dora": True}), "json": "{r: 4", "list": "[4]"}
    (folder / "adapter_config.json").write_text(config.get(how, json.dumps(settings)))
    (folder / "adapter_model.safetensors").write_bytes(weights[:100] if how == "truncated" else weights)


BROKEN = {"dora": "use_dora=True is not supported", "json": "adapter_config.json cannot be read",
          "list": "adapter_config.json holds list", "truncated": "adapter_model.safetensors cannot be read"}


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_an_adapter_that_cannot_be_served_is_refused_by_name(tiny_llama_dir, lora_dir, tmp_path, how):
    _broken_adapter(lora_dir, tmp_path / how, how)
    llm = _llm(tiny_llama_dir, tmp_path, max_loras=2, num_blocks=16)
    with pytest.raises(LoRAError, match=f"'{how}'.*{BROKEN[how]}") as caught:
        llm.generate([[5, 6]], GREEDY, lora=how)
    assert input_error(caught.value).status == 400
    assert llm.generate([[5, 6]], GREEDY)[0].outputs[0].token_ids  # the engine serves on


def test_lora_dir_settings_are_checked(tiny_llama_dir, lora_dir):
    with pytest.raises(ValueError, match="max_loras \\(1\\) leaves no room"):
        with_overrides(TandemConfig(), model=str(tiny_llama_dir), lora_dir=str(lora_dir), max_loras=1,
                       lora_modules={"all": str(lora_dir / "all")})
    with pytest.raises(ValueError, match="in one process"):
        with_overrides(TandemConfig(), model=str(tiny_llama_dir), lora_dir=str(lora_dir), tensor_parallel_size=2)


def test_the_room_kept_for_an_adapter_is_one_on_every_projection(tiny_llama_dir, lora_dir):
    """``adapter_bytes`` (what the worker keeps free per on-demand slot) equals the float32 tensors
    PEFT saved for a rank-4 adapter on all seven projections."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from cluster.models.lora import adapter_bytes

    saved = sum(t.numel() * 4 for t in load_file(str(lora_dir / "all" / "adapter_model.safetensors")).values())
    assert adapter_bytes(AutoConfig.from_pretrained(tiny_llama_dir), 4, 4) == saved


def _deltas(core, until) -> dict[str, list]:
    """Step the core (admitting what its reads let in) until ``until()``; each request's deltas."""
    seen: dict[str, list] = {}
    for _ in range(500):
        if until():
            return seen
        core.take_reads()
        if core.engine.has_unfinished():
            assert core.step()
        else:
            time.sleep(0.01)  # a read under way in its thread
        message = core.take_message(time.monotonic())
        for rid, delta in (message.deltas if message is not None else []):
            seen.setdefault(rid, []).append(delta)
    raise AssertionError("the engine core did not get there")


def _tokens(deltas) -> list[int]:
    assert deltas[0].accepted and all(d.error is None for d in deltas)
    return [t for d in deltas for t in d.token_ids]


def test_the_engine_core_steps_on_while_an_adapter_is_read(tiny_llama_dir, lora_dir, references, monkeypatch):
    """The engine core reads an adapter's folder in a thread: a base request runs to its end while
    that read is held; then the adapter's requests (one read for both) are admitted and give PEFT's
    tokens. A request aborted during the read is forgotten: no delta, no block."""
    prompts, expected = references
    engine = _llm(tiny_llama_dir, lora_dir, max_loras=2).engine
    core, adapters, release, reads = EngineCore(engine), engine.adapters, threading.Event(), []
    read = adapters.read

    def held_read(name):
        reads.append(name)
        assert release.wait(timeout=60)
        return read(name)

    monkeypatch.setattr(adapters, "read", held_read)
    for rid, prompt, lora in (("base", 0, None), ("qv-0", 0, "qv"), ("qv-1", 1, "qv"), ("gone", 1, "qv")):
        core.handle(AddRequest(GenerateRequest(rid, prompts[prompt], GREEDY, lora=lora)))
    assert (adapters.num_reading, engine.num_waiting) == (3, 4)  # counted for the router and the queue cap
    sink = MemorySink()
    EngineMetricsCollector(engine, sink).poll()
    assert sink.gauges[("tandem_lora_requests_waiting", ())] == 3
    core.handle(AbortRequest("gone"))
    seen = _deltas(core, lambda: not engine.has_unfinished())
    assert _tokens(seen.pop("base")) == expected[None][0] and seen == {}  # nothing of the adapter's yet
    assert adapters.num_reading == 2 and adapters.loaded == []
    release.set()
    seen = _deltas(core, lambda: reads and not adapters.num_reading and not engine.has_unfinished())
    assert reads == ["qv"] and set(seen) == {"qv-0", "qv-1"}
    assert [_tokens(seen[f"qv-{i}"]) for i in (0, 1)] == expected["qv"]
    assert adapters.loaded == ["qv"] and adapters.mean_load_seconds > 0
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks


def test_an_adapter_the_engine_core_cannot_read_fails_its_requests_alone(tiny_llama_dir, lora_dir, tmp_path):
    """A folder read in the core's thread that does not load: each request naming it gets the 400
    naming why, and the core serves on."""
    _broken_adapter(lora_dir, tmp_path / "broken", "truncated")
    engine = _llm(tiny_llama_dir, tmp_path, max_loras=2, num_blocks=16).engine
    core = EngineCore(engine)
    for rid, lora in (("a", "broken"), ("b", "broken"), ("base", None)):
        core.handle(AddRequest(GenerateRequest(rid, [5, 6, 7], GREEDY, lora=lora)))
    seen = _deltas(core, lambda: not engine.adapters.num_reading and not engine.has_unfinished())
    for rid in ("a", "b"):
        (delta,) = seen[rid]
        assert delta.error.status == 400 and "'broken'" in delta.error.message
        assert "cannot be read" in delta.error.message
    assert len(_tokens(seen["base"])) == MAX_TOKENS
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks


def test_the_in_process_core_serves_adapters_read_in_a_thread(tiny_llama_dir, lora_dir, references):
    prompts, expected = references
    client = InprocClient(_llm(tiny_llama_dir, lora_dir, max_loras=2).engine)

    async def stream(rid, lora):
        return [d async for d in client.generate(GenerateRequest(rid, prompts[1], GREEDY, lora=lora))]

    async def run():
        try:
            return await asyncio.gather(stream("all", "all"), stream("base", None), stream("missing", "missing"))
        finally:
            await client.shutdown()

    with_adapter, base, missing = asyncio.run(run())
    assert [_tokens(with_adapter), _tokens(base)] == [expected["all"][1], expected[None][1]]
    assert len(missing) == 1 and missing[0].error.status == 404 and "'missing'" in missing[0].error.message
