"""Prefix caching on the embedded default: chat turns share a system prompt and history."""

from __future__ import annotations

import pytest

from cluster.engine.llm import LLM, apply_chat_template
from cluster.shared.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a patient tutor for a small museum. Answer in two sentences, mention one exhibit "
    "by name, and never invent opening hours. The museum has a hall of clocks, a room of maps, "
    "a gallery of ship models and a garden with a sundial. "
) * 3
QUESTIONS = [["What is in the hall of clocks?", "And the sundial?"],
             ["Do you have maps of the sea?", "Which is the oldest?"],
             ["Tell me about the ship models.", "Can children touch them?"]]


def _conversations(llm: LLM, seeded: bool) -> tuple[list[list[int]], int]:
    histories = [[{"role": "system", "content": SYSTEM}] for _ in QUESTIONS]
    outputs = []
    for turn in range(2):
        prompts = []
        for history, questions in zip(histories, QUESTIONS):
            history.append({"role": "user", "content": questions[turn]})
            prompts.append(apply_chat_template(llm.tokenizer, history))
        params = [SamplingParams(max_tokens=16, temperature=0.8, seed=i) if seeded
                  else SamplingParams(max_tokens=16, temperature=0) for i in range(len(prompts))]
        results = llm.generate(prompts, params)
        for history, result in zip(histories, results):
            history.append({"role": "assistant", "content": result.outputs[0].text})
            outputs.append(result.outputs[0].token_ids)
    llm.engine.check_invariants()
    return outputs, llm.engine.stats().num_computed_tokens


@pytest.mark.parametrize("seeded", [False, True])
def test_chat_outputs_equal_with_cache_on_and_off(seeded):
    on = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", kv_cache_memory="128MiB")
    off = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", kv_cache_memory="128MiB",
              enable_prefix_caching=False)
    outputs_on, computed_on = _conversations(on, seeded)
    outputs_off, computed_off = _conversations(off, seeded)
    assert outputs_on == outputs_off
    # The first turn's three prompts are admitted together, before anything is cached;
    # the second turn reuses system prompt and history.
    assert computed_on < 0.7 * computed_off
    assert on.engine.stats().prefix_cache_hits > 0
