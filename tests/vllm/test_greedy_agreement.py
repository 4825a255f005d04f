"""Greedy outputs of the two engines on the default model agree for 16 tokens.

Both run SmolLM2-135M-Instruct in float32 from the same converted weights; Hugging Face
``transformers`` greedy decoding is computed too, so a disagreement says which engine
left the reference."""

from __future__ import annotations

import pytest

from tests.serve.conftest import API_KEY, MODEL

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "To make a cup of tea, first",
]


@pytest.fixture(scope="module")
def hf_greedy():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster.models.loader import resolve_model

    path = str(resolve_model("smollm2-135m-instruct").path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def run(prompt: str) -> list[int]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
        return out[0, ids.shape[1]:].tolist()

    return run


def test_native_and_vllm_greedy_agree_on_the_default_model(server_url, hf_greedy):
    from cluster.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    report = []
    for prompt in PROMPTS:
        texts = {}
        for group in ("native", "vllm"):
            import openai

            client = openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0, timeout=300,
                                   default_headers={"X-Tandem-Group": group})
            texts[group] = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                     extra_body={"ignore_eos": True}).choices[0].text
        texts["hf"] = tokenizer.decode(hf_greedy(prompt))
        report.append((prompt, texts))
    disagree = [(p, t) for p, t in report if t["native"] != t["vllm"]]
    assert not disagree, "\n".join(f"{p!r}: native {t['native']!r} vllm {t['vllm']!r} hf {t['hf']!r}"
                                   for p, t in disagree)
    # And both are Hugging Face's greedy text.
    assert all(t["native"] == t["hf"] for _, t in report), report
