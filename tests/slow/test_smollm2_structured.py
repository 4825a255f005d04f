"""Structured outputs on the embedded default: 50 random JSON schemas (nested objects, arrays,
enums, bounded numbers and strings) give outputs that parse and validate (jsonschema), greedy
and sampled; greedy outputs are the same with and without speculation."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.json_schemas import random_schemas
from cluster.engine.llm import LLM, apply_chat_template
from cluster.shared.sampling_params import SamplingParams
from cluster.structured.constraint import StructuredOutputs

pytestmark = pytest.mark.slow

SCHEMAS = random_schemas(50, seed=0)


def _generate(llm: LLM, temperature: float) -> list:
    prompts = [apply_chat_template(llm.engine.tokenizer, [{"role": "user", "content":
               "Give an example object for this JSON schema: " + json.dumps(schema)}]) for schema in SCHEMAS]
    params = [SamplingParams(max_tokens=400, temperature=temperature, seed=i,
                             structured_outputs=StructuredOutputs(json=schema)) for i, schema in enumerate(SCHEMAS)]
    outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
    llm.engine.check_invariants()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.pool.num_blocks
    return outputs


def _engine(**speculation) -> LLM:
    return LLM("smollm2-135m-instruct", dtype="float32", device="cpu", kv_cache_memory="256MiB", **speculation)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return _engine()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_validates_against_its_schema(plain, temperature):
    for schema, out in zip(SCHEMAS, _generate(plain, temperature)):
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_greedy_outputs_equal_with_and_without_speculation(plain):
    expected = [o.token_ids for o in _generate(plain, 0.0)]
    speculative = _engine(method="ngram", num_speculative_tokens=4, controller="fixed")
    assert [o.token_ids for o in _generate(speculative, 0.0)] == expected
    assert speculative.engine.stats().spec.num_accepted_tokens > 0


def test_bench_structured_measures_both_engines_and_its_result_prints_again(tmp_path, capsys):
    """``tandem bench structured`` on the embedded default: a cell per engine and batch size,
    every constrained output checked against the schema's opening by the benchmark itself."""
    from cluster.cli import main

    out = tmp_path / "structured.json"
    assert main(["bench", "structured", "configs/local.yaml", "--batch-sizes", "1,2", "--output-len", "8",
                 "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(c["speculation"], c["batch_size"]) for c in result["cells"]] == [
        ("none", 1), ("none", 2), ("suffix", 1), ("suffix", 2)]  # local.yaml's method
    assert all({"free_tok_s", "constrained_tok_s", "grammar_share"} <= set(c) for c in result["cells"])
    assert result["run"]["benchmark"] == "structured"
    printed = capsys.readouterr().out
    assert main(["bench", "show", str(out)]) == 0
    assert capsys.readouterr().out.split("wrote")[0] == printed.split("wrote")[0]
