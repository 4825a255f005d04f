"""StructuredOutputs: validation with the request field in the error, the grammar it compiles
to (checked by llguidance on the tiny test vocabulary), bounded JSON by default."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from cluster.structured.bitmask import allowed_tokens, apply_token_bitmask
from cluster.structured.constraint import ConstraintError, StructuredOutputs, bounded_numbers, vllm_fields
from cluster.structured.matcher import GrammarMatcher, bitmask_words
from cluster.structured.vocabulary import grammar_tokenizer


@pytest.fixture(scope="module")
def vocabulary(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    return tokenizer, grammar_tokenizer(tokenizer, 256, tokenizer.eos_token_id)


def _accepts(vocabulary, constraint: StructuredOutputs, text: str) -> bool:
    tokenizer, tokens = vocabulary
    ids = tokenizer.encode(text, add_special_tokens=False)
    matcher = GrammarMatcher(tokens, constraint)
    return matcher.num_valid(ids) == len(ids) and matcher.advance(ids) == len(ids) and matcher.is_stopped


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"),
    ({"json": True, "regex": "a"}, "exactly one of"),
    ({"json": {"type": "objectx"}}, "objectx"),
    ({"json": [1, 2]}, "must be an object"),
    ({"regex": "a(b"}, "regex"),
    ({"choice": "yes"}, "list of non-empty strings"),
    ({"choice": ["a", ""]}, "list of non-empty strings"),
    ({"json": {"type": "string", "minLength": 5, "maxLength": 2}}, "minLength"),
    ({"grammar": "start: missing_rule"}, "missing_rule"),
    ({"regex": "a\udcff"}, "lone surrogate"),
    ({"choice": ["ok", "\ud800"]}, "lone surrogate"),
    ({"grammar": 'start: "\udcff"'}, "lone surrogate"),
])
def test_bad_constraints_name_the_request_field(kwargs, message):
    with pytest.raises(ConstraintError, match=message) as err:
        StructuredOutputs(param="response_format", **kwargs)
    assert err.value.param == "response_format"
    assert str(err.value).startswith("response_format")


def test_json_is_bounded_by_default(vocabulary):
    schema = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]})
    assert _accepts(vocabulary, schema, '{"a": 1.5}')
    assert not _accepts(vocabulary, schema, '{  "a": 1.5}')  # no whitespace but the separators
    assert not _accepts(vocabulary, schema, '{"a": 1.1234567}')  # at most six decimals
    assert not _accepts(vocabulary, schema, '{"a": 12345678901234567}')  # within +-10^15
    flexible = StructuredOutputs(json=schema.json, flexible_whitespace=True)
    assert _accepts(vocabulary, flexible, '{  "a":   1.5 }')


def test_a_schemas_own_bounds_win():
    out = bounded_numbers({"type": "object", "properties": {
        "type": {"type": "number", "multipleOf": 0.5, "exclusiveMaximum": 3},
        "n": {"type": ["integer", "null"], "minimum": 0}}})
    assert out["properties"]["type"] == {"type": "number", "multipleOf": 0.5, "exclusiveMaximum": 3,
                                         "minimum": -10**15}
    assert out["properties"]["n"] == {"type": ["integer", "null"], "minimum": 0, "maximum": 10**15}


def test_regex_choice_and_lark(vocabulary):
    assert _accepts(vocabulary, StructuredOutputs(regex="[0-9]{2}"), "42")
    assert not _accepts(vocabulary, StructuredOutputs(regex="[0-9]{2}"), "4a")
    assert _accepts(vocabulary, StructuredOutputs(choice=["yes", "no"]), "no")
    assert not _accepts(vocabulary, StructuredOutputs(choice=["yes", "no"]), "nope")
    lark = 'start: "<call>" %json {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}'
    assert _accepts(vocabulary, StructuredOutputs(grammar=lark), '<call>{"x": 3}')


def test_masks_for_draft_positions_leave_the_state_alone(vocabulary):
    tokenizer, tokens = vocabulary
    matcher = GrammarMatcher(tokens, StructuredOutputs(regex="ab|cd"))
    a, b, c = (tokenizer.convert_tokens_to_ids(ch) for ch in "abc")
    bitmask = torch.zeros(2, bitmask_words(256), dtype=torch.int32)
    matcher.fill_masks(bitmask, 0, [a])
    allowed = allowed_tokens(bitmask, 256)
    assert set(allowed[0].nonzero().flatten().tolist()) == {a, c}
    assert allowed[1].nonzero().flatten().tolist() == [b]
    assert matcher.num_valid([c]) == 1 and matcher.num_consumed == 0  # still at the start
    logits = torch.zeros(2, 256)
    masked = apply_token_bitmask(logits, bitmask)
    assert torch.isinf(masked[1]).sum() == 255 and masked[1, b] == 0
    assert torch.equal(apply_token_bitmask(logits, torch.full_like(bitmask, -1)), logits)

def test_drafts_past_the_grammars_end_leave_the_state_alone(vocabulary):
    """Drafts that complete the grammar and then end the text (an n-gram draft copying ``...>`` and
    the end of an earlier turn) must not move the state: llguidance takes the end-of-text token
    after completion without recording it, so a rollback by the drafts' count undid one token
    too many and the next real token hit a dead end (issue 71)."""
    tokenizer, tokens = vocabulary
    eos = tokenizer.eos_token_id
    a, b, c, d = (tokenizer.convert_tokens_to_ids(ch) for ch in "abcd")
    matcher = GrammarMatcher(tokens, StructuredOutputs(regex="abcd"))
    assert matcher.advance([a, b]) is None and matcher.num_consumed == 2
    drafts = [c, d, eos, eos]
    assert matcher.num_valid(drafts) >= 3  # c, d and the end
    bitmask = torch.zeros(len(drafts) + 1, bitmask_words(256), dtype=torch.int32)
    matcher.fill_masks(bitmask, 0, drafts[:3])
    allowed = allowed_tokens(bitmask, 256)
    assert allowed[0].nonzero().flatten().tolist() == [c]
    assert allowed[1].nonzero().flatten().tolist() == [d]
    assert allowed[2].nonzero().flatten().tolist() == [eos] == allowed[3].nonzero().flatten().tolist()
    # The state still stands after "ab": the next real tokens complete it, no dead end.
    assert matcher.num_valid([c, d]) == 2
    assert matcher.advance([a, b, c, d]) == 4 and matcher.is_stopped and not matcher.is_dead



def test_vllm_gets_the_same_grammar():
    from llguidance import LLMatcher

    assert vllm_fields(StructuredOutputs(regex="a+")) == {"regex": "a+"}
    assert vllm_fields(StructuredOutputs(choice=["x", "y"])) == {"choice": ["x", "y"]}
    fields = vllm_fields(StructuredOutputs(json={"type": "object", "properties": {"n": {"type": "number"}}}))
    lark = fields["grammar"]
    assert lark.startswith("start: %json ") and '"whitespace_flexible": false' in lark and '"multipleOf": 1e-06' in lark
    assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark)) == ""


def test_errors_carry_their_request_field():
    from cluster.hosting.backend import error_param
    from cluster.errors import ParamError
    from cluster.shared.sampling_params import SamplingParams

    assert error_param(ConstraintError("tool_choice", "tool_choice: bad")) == "tool_choice"
    with pytest.raises(ParamError) as err:
        SamplingParams(top_p=0.0)
    assert err.value.param == "top_p" and error_param(err.value) == "top_p"
    assert error_param(ValueError("temperature must be >= 0")) == "temperature"  # vLLM's, by its message
    assert error_param(ValueError("something else")) is None
