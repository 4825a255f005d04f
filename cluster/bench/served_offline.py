"""Tandem's engine alone on the saturation cells of ``tandem bench served``.

The same config's engine (the group's settings, every core) gets the cell's requests all
at once, of the same shapes as vLLM's client sends: ``random`` prompts of ``input_len``
random token ids, or the instruction, code or agentic prompts with the chat template
(:func:`~cluster.bench.workloads.prompt_sets.served_prompt_texts`), repeated to
``num_prompts``; ``output_len`` tokens each (ignore_eos), temperature 1. The served figure
over this one is what the serving layer keeps of the engine's throughput at that load.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from cluster.bench.workloads.prompt_sets import VLLM_DATASETS, served_prompt_texts
from cluster.config import group_engine_config, load_config, with_overrides
from cluster.engine.engine import Engine
from cluster.engine.llm import apply_chat_template
from cluster.shared.sampling_params import SamplingParams


def offline_output_throughput(config_path: str | Path, dataset: str, num_prompts: int, input_len: int,
                              output_len: int, seed: int) -> dict:
    config = load_config(config_path)
    group = config.serve.groups[0]
    config = group_engine_config(config, group.name)
    if config.device.num_threads is None and group.num_gpus == 0:
        config = with_overrides(config, num_threads=max(1, int(group.num_cpus)))
    engine = Engine(config)
    rng = random.Random(seed)
    if dataset == "random":
        prompts = [[rng.randrange(engine.vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]
    elif dataset in VLLM_DATASETS:
        texts = served_prompt_texts(dataset, engine.tokenizer)
        rng.shuffle(texts)
        prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        prompts = [prompts[i % len(prompts)] for i in range(num_prompts)]
    else:
        lines = (Path(__file__).parent / "data" / "instructions.jsonl").read_text().splitlines()
        texts = [json.loads(line)["prompt"] for line in lines if line.strip()]
        rng.shuffle(texts)
        prompts = [engine.tokenizer.encode(apply_chat_template(engine.tokenizer, [{"role": "user", "content": t}]),
                                           add_special_tokens=False) for t in texts]
        prompts = [prompts[i % len(prompts)] for i in range(num_prompts)]
    params = SamplingParams(max_tokens=output_len, temperature=1.0, ignore_eos=True)
    started = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params)
    num_tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            num_tokens += len(out.outputs[0].delta_token_ids)
    seconds = time.perf_counter() - started
    engine.worker.close()
    return {"output_throughput": num_tokens / seconds, "seconds": seconds, "num_prompts": num_prompts,
            "max_num_seqs": config.scheduler.max_num_seqs}
