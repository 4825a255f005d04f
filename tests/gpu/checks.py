"""The correctness checks of the GPU validation, run on the device they are given.

Each returns a :class:`CheckResult`; none raises for a wrong answer (``failed``, with where the
outputs part) and the caller turns an exception into ``error``. References no one here wrote:

- **parity**: Tandem's batched greedy tokens equal ``transformers``' ``generate`` (one prompt at a
  time, float32, EOS disabled on both sides), on the same device;
- **speculative**: greedy tokens with n-gram, draft-model or draft-head speculation equal plain
  decoding on the same engine settings, and speculation did propose tokens (else the check
  exercised nothing); with CUDA graphs, verify steps (and a head's passes) replayed them;
- **kv**: a pool too small for the batch (requests preempted and recomputed) gives the tokens of a
  roomy one, with ``check_invariants`` after every step and every block free at the end
  (``tests/engine_helpers.run_to_completion``), and at least one preemption;
- **sync**: no model forward (or CUDA-graph replay, decode or verify), sampling step, verification of
  drafts or draft-head pass synchronises with the host, greedy or sampled (CUDA only);
- **lora**: requests of two adapters and of the base model in one batch give PEFT's greedy tokens
  (PEFT made the adapters and runs the reference on the same device);
- **core**: the engine in its engine-core process (``ProcessClient``, what ``tandem serve`` runs),
  started from a fresh interpreter on the device, streams the in-process engine's greedy tokens,
  frees a closed stream's blocks, and a core killed mid-stream fails its requests with a 503.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import os
import random
import signal
import time
from pathlib import Path

import torch

from cluster.config import TandemConfig, with_overrides
from cluster.engine.engine import Engine
from cluster.shared.sampling_params import SamplingParams
from report import CheckResult

ROOT = Path(__file__).resolve().parents[2]


def _test_helpers(name: str):
    """tests/<name>.py, loaded by path (a package named ``tests`` elsewhere must not win)."""
    spec = importlib.util.spec_from_file_location(f"tandem_{name}", ROOT / "tests" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_engine_helpers = _test_helpers("engine_helpers")
run_to_completion = _engine_helpers.run_to_completion
close_after_tokens = _engine_helpers.close_after_tokens


def random_prompts(seed: int, lengths: tuple[int, ...], vocab_size: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def compare(expected: list[list[int]], got: list[list[int]]) -> tuple[bool, dict]:
    """Whether the outputs are equal, and for each one that is not, where it first differs."""
    mismatches = []
    for index, (want, have) in enumerate(zip(expected, got)):
        if want != have:
            first = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
            mismatches.append({"prompt": index, "first_mismatch": first, "expected_len": len(want),
                               "got_len": len(have), "expected": want[first:first + 4], "got": have[first:first + 4]})
    if len(expected) != len(got):
        mismatches.append({"count": {"expected": len(expected), "got": len(got)}})
    return not mismatches, {"num_outputs": len(got), "mismatches": mismatches}


def make_engine(model: str, device: str, **overrides) -> Engine:
    return Engine(with_overrides(TandemConfig(), model=model, device=device, dtype="float32", **overrides))


def release(engine: Engine | None = None) -> None:
    """Give back what an engine held before the next check loads its models."""
    if engine is not None:
        engine.worker.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def tandem_greedy(model: str, device: str, prompts, max_tokens: int, **overrides) -> tuple[list[list[int]], Engine]:
    engine = make_engine(model, device, **overrides)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return run_to_completion(engine, prompts, params), engine


def hf_greedy(model_dir: Path, device: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate``, one prompt at a time (no padding), float32, no EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None  # Tandem's ignore_eos keeps EOS sampleable: ban it nowhere
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    del model
    release()
    return outputs


def parity(name: str, model_dir: Path, device: str, prompts: list[list[int]], max_tokens: int,
           **overrides) -> CheckResult:
    expected = hf_greedy(model_dir, device, prompts, max_tokens)
    got, engine = tandem_greedy(str(model_dir), device, prompts, max_tokens, **overrides)
    release(engine)
    ok, data = compare(expected, got)
    detail = (f"{len(got)} prompts x {max_tokens} greedy tokens equal transformers' generate" if ok else
              f"{len(data['mismatches'])} of {len(got)} outputs differ from transformers' generate")
    return CheckResult(name, "passed" if ok else "failed", detail, data)


def speculative(name: str, model: str, device: str, prompts: list[list[int]], max_tokens: int, spec: dict,
                **overrides) -> CheckResult:
    """Greedy tokens with ``spec`` (method, draft_model, num_speculative_tokens) equal plain decoding."""
    plain, engine = tandem_greedy(model, device, prompts, max_tokens, **overrides)
    release(engine)
    got, engine = tandem_greedy(model, device, prompts, max_tokens, **spec, **overrides)
    stats = engine.stats().spec
    graphs = engine.worker.runner.graphs
    graph_steps = graphs.summary["steps"] if graphs is not None else None
    head_graphs = getattr(engine.proposer, "graphs", None)  # a draft head's own
    head_passes = head_graphs.summary["passes"] if head_graphs is not None else None
    release(engine)
    ok, data = compare(plain, got)
    data.update(num_draft_tokens=stats.num_draft_tokens, num_accepted_tokens=stats.num_accepted_tokens,
                graph_steps=graph_steps, head_graph_passes=head_passes)
    if ok and stats.num_draft_tokens == 0:
        return CheckResult(name, "failed", "no token was ever proposed: the check exercised nothing", data)
    if ok and graph_steps is not None and graph_steps["verify"] == 0:
        return CheckResult(name, "failed", "CUDA graphs on, but no verify step replayed one", data)
    if ok and head_passes is not None and not (head_passes["catch_up"] and head_passes["draft"]):
        return CheckResult(name, "failed", f"CUDA graphs on, but the head's passes replayed {head_passes}", data)
    rate = stats.num_accepted_tokens / max(1, stats.num_draft_tokens)
    replayed = f"; {graph_steps['verify']} verify steps replayed CUDA graphs" if graph_steps is not None else ""
    if head_passes is not None:
        replayed += f", the head's {head_passes['catch_up']} catch-up and {head_passes['draft']} draft passes too"
    detail = (f"greedy tokens equal plain decoding ({stats.num_draft_tokens} drafted, {rate:.0%} accepted{replayed})"
              if ok else f"{len(data['mismatches'])} of {len(got)} outputs differ from plain decoding")
    return CheckResult(name, "passed" if ok else "failed", detail, data)


def preemption(name: str, model: str, device: str, prompts: list[list[int]], max_tokens: int, tight: dict,
               **overrides) -> CheckResult:
    """A pool of ``tight`` settings (few blocks) gives the tokens of a roomy one, preempting on the way."""
    roomy, engine = tandem_greedy(model, device, prompts, max_tokens, num_blocks=128, **overrides)
    release(engine)
    got, engine = tandem_greedy(model, device, prompts, max_tokens, **tight, **overrides)
    num_preemptions, num_blocks = engine.stats().num_preemptions, engine.block_manager.pool.num_blocks
    release(engine)
    ok, data = compare(roomy, got)
    data.update(num_preemptions=num_preemptions, num_blocks=num_blocks)
    if ok and num_preemptions == 0:
        return CheckResult(name, "failed", f"{num_blocks} blocks never preempted: the check exercised nothing", data)
    detail = (f"{num_preemptions} preemptions in {num_blocks} blocks; tokens equal a roomy pool's, invariants held "
              "every step, every block free at the end" if ok else
              f"{len(data['mismatches'])} of {len(got)} outputs differ from a roomy pool's")
    return CheckResult(name, "passed" if ok else "failed", detail, data)


def no_host_sync(name: str, model: str, device: str, prompts: list[list[int]], max_tokens: int,
                 **overrides) -> CheckResult:
    """Nothing between a step's inputs and its one read of the result waits on the host: every
    model forward (and CUDA-graph replay), the sampler and its parameters, the verification of
    drafts (``verify_on_device``: greedy, rejection and coupled) and the logprobs of the tokens it
    emits (``_emitted_logprobs``), and, with a draft head, each of
    its passes and draft choices run under ``torch.cuda.set_sync_debug_mode("error")``, which
    raises on any synchronising CUDA call (``.item()``, a blocking copy, ``nonzero``...). Greedy
    requests, then sampled ones (half of them seeded) in one batch."""
    if not device.startswith("cuda"):
        return CheckResult(name, "skipped", "CUDA only: synchronisation is a CUDA notion")
    from cluster.runner import model_runner, rejection

    engine = make_engine(model, device, **overrides)
    # every third request asks for logprobs: they keep drafting, and the emitted tokens' logprobs are computed too
    greedy = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                             logprobs=2 if i % 3 == 0 else None) for i in range(len(prompts))]
    sampled = [SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, ignore_eos=True,
                              seed=i if i % 2 else None, logprobs=2 if i % 3 == 0 else None)
               for i in range(len(prompts))]
    run_to_completion(engine, prompts, greedy)  # warm-up: compiling the kernels may synchronise
    run_to_completion(engine, prompts, sampled)
    runner, proposer = engine.worker.runner, engine.proposer
    counts: dict[str, int] = {}

    def guarded(fn, kind: str):
        def call(*args, **kwargs):
            outer = torch.cuda.get_sync_debug_mode()  # guards nest (a head's choice reads sampling parameters)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(outer)
                counts[kind] = counts.get(kind, 0) + 1
        return call

    runner.model.forward = guarded(runner.model.forward, "forwards")
    if runner.graphs is not None:
        runner.graphs.forward = guarded(runner.graphs.forward, "forwards")
    runner.sampler = guarded(runner.sampler, "samples")
    runner.sampling_metadata = guarded(runner.sampling_metadata, "samples")
    originals = (model_runner.compute_probs, rejection.verify_on_device, model_runner._emitted_logprobs)
    model_runner.compute_probs = guarded(model_runner.compute_probs, "verifications")
    rejection.verify_on_device = guarded(rejection.verify_on_device, "verifications")
    model_runner._emitted_logprobs = guarded(model_runner._emitted_logprobs, "verified logprobs")
    if hasattr(proposer, "draft_pass"):  # a draft head
        proposer.draft_pass = guarded(proposer.draft_pass, "head passes")
        proposer._choose = guarded(proposer._choose, "head passes")
    try:
        run_to_completion(engine, prompts, greedy)
        run_to_completion(engine, prompts, sampled)
    finally:
        model_runner.compute_probs, rejection.verify_on_device, model_runner._emitted_logprobs = originals
    data = {**counts, "attention": runner.attention, "cuda_graphs": runner.graphs is not None}
    release(engine)
    if overrides.get("method") not in (None, "none") and not counts.get("verifications"):
        return CheckResult(name, "failed", "speculation on, but no sampled verification ran", data)
    done = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    return CheckResult(name, "passed", f"{done} without a host synchronisation (attention {data['attention']}, "
                       f"CUDA graphs {'on' if data['cuda_graphs'] else 'off'})", data)


def lora_parity(name: str, model_dir: Path, device: str, prompts: list[list[int]], max_tokens: int, work: Path,
                **overrides) -> CheckResult:
    """Each prompt under two PEFT adapters (one loaded at start, one from ``lora_dir`` when first
    asked for) and under none, interleaved in one batch, equals PEFT's greedy tokens. The adapter
    requests stop early, so the last steps run the base model alone. On CUDA, decode steps replay
    graphs: those with adapter tokens the bucket's LoRA graph (counted: the check fails if none
    did), the last ones the base graph."""
    from transformers import AutoModelForCausalLM

    from cluster.engine.llm import LLM

    helpers = _test_helpers("lora_helpers")  # imports peft: a machine without it errors here alone
    adapters = {"all": helpers.save_peft_adapter(model_dir, work / "lora-all", seed=1),
                "qv": helpers.save_peft_adapter(model_dir, work / "lora-dir" / "qv", seed=2,
                                                targets=["q_proj", "v_proj"], rank=8, alpha=16, rslora=True)}
    expected = {}
    for adapter, path in adapters.items():
        expected[adapter] = helpers.reference_greedy(helpers.peft_model(model_dir, path).to(device), prompts,
                                                     max_tokens, device)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    expected[None] = helpers.reference_greedy(base, prompts, max_tokens, device)
    del base
    release()
    # "all" loaded at start, "qv" from lora_dir at its first request: after the graphs were captured
    llm = LLM(str(model_dir), device=device, dtype="float32", lora_modules={"all": str(adapters["all"])},
              lora_dir=str(work / "lora-dir"), max_loras=2, max_lora_rank=8, **overrides)
    replays = {"lora": 0, "base": 0}
    captured = llm.engine.worker.runner.graphs
    if captured is not None:
        forward = captured.forward

        def counted(inputs, token_slots=None):
            replays["base" if token_slots is None else "lora"] += 1
            return forward(inputs, token_slots)
        captured.forward = counted
    order = [(i, adapter) for i in range(len(prompts)) for adapter in ("qv", None, "all")]
    short = max_tokens // 3
    params = [SamplingParams(max_tokens=max_tokens if adapter is None else short, temperature=0, ignore_eos=True)
              for _, adapter in order]
    outs = llm.generate([prompts[i] for i, _ in order], params, lora=[adapter for _, adapter in order])
    engine = llm.engine
    engine.check_invariants()
    all_free = engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks
    graphs = engine.worker.runner.graphs is not None
    release(engine)
    want = [expected[adapter][i][:max_tokens if adapter is None else short] for i, adapter in order]
    ok, data = compare(want, [o.outputs[0].token_ids for o in outs])
    changed = all(expected[a] != expected[None] for a in adapters)
    data.update(all_blocks_free=all_free, cuda_graphs=graphs, adapters_change_output=changed,
                graph_steps_with_adapters=replays["lora"], graph_steps_base=replays["base"])
    if ok and not changed:
        return CheckResult(name, "failed", "an adapter left the output unchanged: the check exercised nothing", data)
    if ok and graphs and not replays["lora"]:
        return CheckResult(name, "failed", "no decode step with adapter tokens replayed a CUDA graph", data)
    if ok and not all_free:
        return CheckResult(name, "failed", "tokens equal PEFT's, but KV blocks were left in use", data)
    detail = (f"{len(order)} requests (2 adapters, one from lora_dir, and the base, interleaved) equal PEFT's "
              "greedy tokens; "
              f"CUDA graphs {'on' if graphs else 'off'} ({replays['lora']} steps with adapters, "
              f"{replays['base']} without)" if ok else
              f"{len(data['mismatches'])} of {len(order)} outputs differ from PEFT's")
    return CheckResult(name, "passed" if ok else "failed", detail, data)


def _device_files(pid: int) -> list[str]:
    """The GPU device files (/dev/nvidia*) the process ``pid`` holds open: CUDA opens them when it starts."""
    names = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            names.append(os.readlink(fd))
        except OSError:  # closed since listed
            continue
    return sorted({n for n in names if n.startswith("/dev/nvidia")})


def engine_core_process(name: str, model: str, device: str, prompts: list[list[int]], max_tokens: int, spec: dict,
                        **overrides) -> CheckResult:
    """The served path's engine on ``device``: ``ProcessClient`` starts the engine-core process (a
    fresh interpreter, as ``tandem serve``'s replica does) with ``spec`` speculation; its streamed
    greedy tokens equal the in-process engine's without speculation, a stream closed after two
    tokens leaves every block free in the core, and SIGKILL on the core ends a stream in flight
    with a 503 and fails the health check. On CUDA the core must hold the GPU's device files open."""
    from cluster.hosting.backend import BackendContext, EngineUnhealthyError
    from cluster.hosting.process_client import ProcessClient
    from cluster.hosting.protocol import GenerateRequest
    from cluster.metrics.collector import MemorySink

    expected, engine = tandem_greedy(model, device, prompts, max_tokens, **overrides)
    release(engine)
    config = with_overrides(TandemConfig(), model=model, device=device, dtype="float32", **spec, **overrides)
    sink = MemorySink()
    backend = ProcessClient(config, config.serve.groups[0], BackendContext(metrics_sink=sink))
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def stream(request_id: str, prompt: list[int], params: SamplingParams, kill_after: int = 0) -> list:
        deltas = []
        async for delta in backend.generate(GenerateRequest(request_id, prompt, params)):
            deltas.append(delta)
            if kill_after and sum(len(d.token_ids) for d in deltas) >= kill_after:
                os.kill(backend.core_pid, signal.SIGKILL)
                kill_after = 0
        return deltas

    async def served() -> list:
        return await asyncio.gather(*(stream(f"p{i}", p, greedy) for i, p in enumerate(prompts)))

    try:
        results = asyncio.run(served())
        got = [[t for d in deltas for t in d.token_ids] for deltas in results]
        ok, data = compare(expected, got)
        errors = [d.error.message for deltas in results for d in deltas if d.error is not None]
        stats = asyncio.run(close_after_tokens(backend, GenerateRequest("early", prompts[0], greedy)))
        files = _device_files(backend.core_pid)
        deadline = time.monotonic() + 10  # an idle core sends its counters within a second (IDLE_POLL_S)
        while spec and sink.counter("spec_decode_num_draft_tokens") == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        data.update(errors=errors, engine_pid=stats["engine_pid"], device_files=files,
                    blocks_free_after_close=stats["num_free_blocks"] == stats["num_blocks"],
                    num_draft_tokens=sink.counter("spec_decode_num_draft_tokens"))
        # A long request, the core killed once it has streamed 4 tokens: the stream must end, not hang.
        killed = asyncio.run(asyncio.wait_for(stream("doomed", prompts[0], SamplingParams(
            max_tokens=4000, temperature=0, ignore_eos=True), kill_after=4), timeout=60))
        last = killed[-1].error
        data["killed_stream_status"] = last.status if last is not None else None
        try:
            backend.check_health()
            data["health_after_kill"] = "passed"
        except EngineUnhealthyError as err:
            data["health_after_kill"] = f"failed: {err}"
    finally:
        start = time.monotonic()
        asyncio.run(backend.shutdown())
    data["shutdown_s"] = round(time.monotonic() - start, 2)
    problems = [f"{len(data['mismatches'])} of {len(got)} streams differ from the in-process engine's tokens"] \
        if not ok else []
    problems += [f"error deltas: {errors[:2]}"] if errors else []
    problems += [] if data["blocks_free_after_close"] else ["blocks held after a stream was closed"]
    problems += [] if data["num_draft_tokens"] > 0 or not spec else ["the core never proposed a token"]
    problems += [] if data["killed_stream_status"] == 503 else ["the killed core's stream did not end with a 503"]
    problems += [] if data["health_after_kill"].startswith("failed") else ["the health check passed a dead core"]
    problems += [] if files or not device.startswith("cuda") else ["the core holds no /dev/nvidia* file open"]
    detail = "; ".join(problems) or (
        f"{len(got)} streams x {max_tokens} tokens equal the in-process engine's ({data['num_draft_tokens']:.0f} "
        f"drafted), a closed stream freed its blocks, the killed core gave a 503 and failed the health check")
    return CheckResult(name, "failed" if problems else "passed", detail, data)
