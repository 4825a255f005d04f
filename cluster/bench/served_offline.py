"""Tandem's engine alone on the cells of ``tandem bench served`` that it can be held to.

The same config's engine (the group's settings, every core) gets the cell's requests, of the same
shapes as vLLM's client sends: ``random`` prompts of ``input_len`` random token ids, or the
instruction, code or agentic prompts with the chat template
(:func:`~cluster.bench.workloads.prompt_sets.served_prompt_texts`), repeated to ``num_prompts``;
``output_len`` tokens each (ignore_eos, unless the bench honours EOS), the cell's temperature (1
where none is sent). A saturation cell's requests come all at once; a closed-loop cell keeps
``concurrency`` in flight, as the client's ``--max-concurrency`` does. Each request's time to its
first token and its time per output token after it are taken as vLLM's client takes them (TPOT =
(end - first token) / (tokens - 1)), from the step that produced them, so the served figure over
this one is what the serving layer adds to the engine's own.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

from cluster.bench.workloads.prompt_sets import VLLM_DATASETS, served_prompt_texts
from cluster.config import group_engine_config, load_config, with_overrides
from cluster.engine.engine import Engine
from cluster.engine.llm import apply_chat_template
from cluster.shared.sampling_params import SamplingParams


def offline_engine_figures(config_path: str | Path, dataset: str, num_prompts: int, input_len: int,
                           output_len: int, seed: int, concurrency: int | None = None,
                           temperature: float | None = None, ignore_eos: bool = True) -> dict:
    """Output throughput, mean TTFT and median TPOT of the engine alone on one cell's requests
    (``concurrency`` None: all at once; ``ignore_eos`` False: outputs end at the model's EOS)."""
    config = load_config(config_path)
    group = config.serve.groups[0]
    config = group_engine_config(config, group.name)
    if config.device.num_threads is None and group.num_gpus == 0:
        config = with_overrides(config, num_threads=max(1, int(group.num_cpus)))
    engine = Engine(config)
    pending = _prompts(engine, dataset, num_prompts, input_len, seed)
    params = SamplingParams(max_tokens=output_len, temperature=1.0 if temperature is None else temperature,
                            ignore_eos=ignore_eos)
    limit = len(pending) if concurrency is None else concurrency
    sent: dict[str, float] = {}  # requests in flight: when each was added
    first: dict[str, float] = {}  # ... and when its first token came
    counts: dict[str, int] = {}
    ttft_s, tpot_s, num_tokens = [], [], 0
    started = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(sent) < limit:
            sent[engine.add_request(pending.pop(0), params)] = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            rid, delta = out.request_id, len(out.outputs[0].delta_token_ids)
            num_tokens += delta
            counts[rid] = counts.get(rid, 0) + delta
            if delta and rid not in first:
                first[rid] = now
                ttft_s.append(now - sent[rid])
            if out.finished:
                sent.pop(rid)
                if counts[rid] > 1:
                    tpot_s.append((now - first[rid]) / (counts[rid] - 1))
    seconds = time.perf_counter() - started
    engine.worker.close()
    return {"output_throughput": num_tokens / seconds, "seconds": seconds, "num_prompts": num_prompts,
            "max_num_seqs": config.scheduler.max_num_seqs, "concurrency": concurrency,
            "mean_ttft_ms": 1000 * statistics.fmean(ttft_s) if ttft_s else None,
            "median_tpot_ms": 1000 * statistics.median(tpot_s) if tpot_s else None}


def _prompts(engine: Engine, dataset: str, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """The cell's prompts as token ids, of the shapes vLLM's client sends."""
    rng = random.Random(seed)
    if dataset == "random":
        return [[rng.randrange(engine.vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]
    if dataset in VLLM_DATASETS:
        texts = served_prompt_texts(dataset, engine.tokenizer)
        rng.shuffle(texts)
        prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    else:
        lines = (Path(__file__).parent / "data" / "instructions.jsonl").read_text().splitlines()
        texts = [json.loads(line)["prompt"] for line in lines if line.strip()]
        rng.shuffle(texts)
        prompts = [engine.tokenizer.encode(apply_chat_template(engine.tokenizer, [{"role": "user", "content": t}]),
                                           add_special_tokens=False) for t in texts]
    return [prompts[i % len(prompts)] for i in range(num_prompts)]
