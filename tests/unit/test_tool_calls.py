"""Tool calls in outputs (cluster/api/tool_calls.py): the parser of each syntax, whole and
streamed, and the grammar of forced calls, checked by llguidance itself on the embedded
model's real tokenizer (SmolLM2) and the tiny test tokenizer. Response shapes are checked
against the ``openai`` client's own types and its stream accumulator.
"""

from __future__ import annotations

import json
import random

import pytest
from llguidance import LLMatcher
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from cluster.api.openai_responses import ChoiceState, chat_body, chat_chunk
from cluster.api.tool_calls import ToolCall, ToolCallParser, forced_call_grammar, parse_tool_calls
from cluster.hosting.protocol import GenerateDelta
from cluster.structured.constraint import StructuredOutputs
from cluster.structured.vocabulary import grammar_tokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
PYDANTIC = {"$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                                "additionalProperties": False}},
            "type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "required": ["at"],
            "additionalProperties": False, "title": "Where"}
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}


def block(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def calls_of(parsed) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls]


# ---- parsing: blocks (hermes, prompt) --------------------------------------------
@pytest.mark.parametrize("tool_format", ["hermes", "prompt"])
def test_blocks_parse_to_calls_with_the_text_around_them_as_content(tool_format):
    text = f'Let me look.\n{block("get_weather", {"city": "Paris"})}\n{block("get_time", {"zone": "UTC"})}\nDone.'
    parsed = parse_tool_calls(text, tool_format)
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
    assert parsed.content == "Let me look.Done."  # whitespace touching a call is dropped
    only = parse_tool_calls(block("get_weather", {"city": "Oslo"}) + "\n", tool_format)
    assert only.content == "" and calls_of(only) == [("get_weather", {"city": "Oslo"})]


def test_text_without_calls_is_content_verbatim():
    for text in ["  Hello there.\n\n", "a < b and <tool", "use <tool_call> tags", "{}"]:
        assert parse_tool_calls(text, "hermes") == (text, [])


@pytest.mark.parametrize("bad", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',  # bad JSON
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',  # never closed
])
def test_malformed_calls_stay_content_verbatim(bad):
    parsed = parse_tool_calls(f"Sure. {bad}", "hermes")
    assert parsed.calls == [] and parsed.content == f"Sure. {bad}"
    mixed = parse_tool_calls(block("get_time", {"zone": "CET"}) + bad, "hermes")
    assert calls_of(mixed) == [("get_time", {"zone": "CET"})] and mixed.content == bad


def test_arguments_written_as_a_json_string_or_missing_are_an_object():
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call><tool_call>{"name": "g"}</tool_call>'
    assert calls_of(parse_tool_calls(text, "hermes")) == [("f", {"a": 1}), ("g", {})]


def test_calls_past_max_calls_are_dropped():
    text = block("get_time", {"zone": "UTC"}) + block("get_time", {"zone": "CET"})
    assert calls_of(parse_tool_calls(text, "hermes", max_calls=1)) == [("get_time", {"zone": "UTC"})]


# ---- parsing: llama3_json ----------------------------------------------------------
def test_llama3_json_objects_are_calls():
    one = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Rome"}}', "llama3_json")
    assert calls_of(one) == [("get_weather", {"city": "Rome"})] and one.content == ""
    two = parse_tool_calls('{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}', "llama3_json")
    assert calls_of(two) == [("a", {}), ("b", {"x": 1})] and two.content == ""


def test_llama3_json_text_around_calls_and_objects_that_are_not_calls():
    text = 'Here: {"note": 1} then {"name": "a", "parameters": {"q": "x"}} ok'
    parsed = parse_tool_calls(text, "llama3_json")
    assert calls_of(parsed) == [("a", {"q": "x"})] and parsed.content == 'Here: {"note": 1} thenok'
    for text in ['{"note": 1}', '{"name": "a", "parameters": 5}', '{"name": "a", "parameters": {', "plain"]:
        assert parse_tool_calls(text, "llama3_json") == (text, [])


# ---- streaming ---------------------------------------------------------------------
STREAM_CASES = [
    ("hermes", f'Checking.\n{block("get_weather", {"city": "Lima", "days": 3})}\n{block("get_time", {"zone": "UTC"})}'),
    ("hermes", 'x < y <tool_call>\n{"name": broken}\n</tool_call> tail  '),
    ("prompt", "  no calls at all, just text with a < and a <tool_ end\n"),
    ("llama3_json", 'Sure {"name": "get_weather", "parameters": {"city": "Kyiv"}}; {"name": "get_time", '
                    '"parameters": {"zone": "CET"}}'),
    ("llama3_json", 'a {"b": 1} c'),
]


@pytest.mark.parametrize("tool_format, text", STREAM_CASES)
def test_a_stream_of_small_deltas_gives_what_the_whole_text_gives(tool_format, text):
    whole = parse_tool_calls(text, tool_format)
    rng = random.Random(0)
    for _ in range(20):
        parser, content, calls, position = ToolCallParser(tool_format), "", [], 0
        while position < len(text):
            size = rng.randint(1, 4)
            step = parser.feed(text[position:position + size])
            content, calls, position = content + step.content, calls + step.calls, position + size
        last = parser.finish()
        content, calls = content + last.content, calls + last.calls
        assert content == whole.content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.calls]


def test_a_call_is_released_the_moment_its_block_closes():
    parser = ToolCallParser("hermes")
    text = "Hi " + block("get_time", {"zone": "UTC"})
    released = [parser.feed(ch) for ch in text]
    assert "".join(p.content for p in released) == "Hi"
    assert [i for i, p in enumerate(released) if p.calls] == [len(text) - 1]


# ---- the grammar of forced calls ---------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from cluster.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("smollm2-135m-instruct", None))
    return tokenizer, grammar_tokenizer(tokenizer, len(tokenizer), tokenizer.eos_token_id)


def accepts(tokenizers, grammar: str, text: str) -> bool:
    """Whether llguidance takes ``text`` as a whole sentence of ``grammar`` (then end of text)."""
    tokenizer, ll_tokenizer = tokenizers
    matcher = LLMatcher(ll_tokenizer, StructuredOutputs(grammar=grammar, param="tool_choice").grammar_text(),
                        log_level=0)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return (matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens)
            and matcher.consume_token(tokenizer.eos_token_id) and not matcher.is_error())


def test_forced_block_calls_accept_valid_calls_only(smollm2_tokenizer):
    one = forced_call_grammar(PARAMETERS, "hermes", several=False)
    several = forced_call_grammar(PARAMETERS, "prompt", several=True)
    weather, time = block("get_weather", {"city": "Paris", "days": 2}), block("get_time", {"zone": "CET"})
    for grammar in (one, several):
        assert accepts(smollm2_tokenizer, grammar, weather)
        assert accepts(smollm2_tokenizer, grammar, time)
        for bad in [block("get_wether", {"city": "Paris"}),  # no such function
                    block("get_weather", {"days": 2}),  # required argument missing
                    block("get_weather", {"city": "Paris", "days": 9}),  # out of range
                    block("get_time", {"zone": "PST"}),  # not in the enum
                    block("get_weather", {"city": "Paris", "extra": 1}),  # additional property
                    "Sure! " + weather,  # text before the call
                    weather.replace('{"city"', '{ "city"')]:  # whitespace beyond the bounded separators
            assert not accepts(smollm2_tokenizer, grammar, bad), bad
    assert accepts(smollm2_tokenizer, several, weather + "\n" + time)
    assert not accepts(smollm2_tokenizer, one, weather + "\n" + time)


def test_forced_llama3_json_calls(smollm2_tokenizer):
    grammar = forced_call_grammar(PARAMETERS, "llama3_json", several=True)
    call = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    assert accepts(smollm2_tokenizer, grammar, call)
    assert accepts(smollm2_tokenizer, grammar, call + "; " + call)
    assert not accepts(smollm2_tokenizer, grammar, call.replace("parameters", "arguments"))
    assert not accepts(smollm2_tokenizer, forced_call_grammar(PARAMETERS, "llama3_json", False), call + "; " + call)


def test_forced_call_parameters_with_defs_and_no_parameters(smollm2_tokenizer, tiny_llama_dir):
    grammar = forced_call_grammar({"where": PYDANTIC, "ping": {"type": "object", "properties": {}}}, "hermes", True)
    assert accepts(smollm2_tokenizer, grammar, block("where", {"at": {"x": 3}}))
    assert not accepts(smollm2_tokenizer, grammar, block("where", {"at": {"y": 3}}))
    assert accepts(smollm2_tokenizer, grammar, block("ping", {}))
    # The character-level tokenizer of the tiny test models (the serve tests' model) has no
    # newline token: the grammar's newlines are optional, so it can still call.
    from cluster.models.loader import load_tokenizer_if_present, resolve_model

    tiny = load_tokenizer_if_present(resolve_model(str(tiny_llama_dir)))
    tiny_tokenizers = (tiny, grammar_tokenizer(tiny, 256, tiny.eos_token_id))
    tight = block("where", {"at": {"x": 3}}).replace("\n", "")
    assert accepts(tiny_tokenizers, grammar, tight) and accepts(tiny_tokenizers, grammar, tight + tight)
    assert not accepts(tiny_tokenizers, grammar, tight.replace("3", '"3"'))
    assert calls_of(parse_tool_calls(tight + tight, "prompt")) == [("where", {"at": {"x": 3}})] * 2


def test_every_forced_output_parses_to_calls_that_match_the_schema():
    """What the grammar makes, the parser reads: the forced syntax is the parsed syntax."""
    for tool_format in ("hermes", "prompt"):
        text = block("get_weather", {"city": "Paris"}) + "\n" + block("get_time", {"zone": "UTC"})
        assert len(parse_tool_calls(text, tool_format).calls) == 2
    llama = '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_time", "parameters": {"zone": "CET"}}'
    assert len(parse_tool_calls(llama, "llama3_json").calls) == 2


# ---- response shapes, read by the openai client -------------------------------------
def _state(text: str, tool_format: str = "hermes") -> ChoiceState:
    state = ChoiceState(0)
    state.add(GenerateDelta(text=text, token_ids=[1], finish_reason="stop", num_prompt_tokens=3,
                            num_output_tokens=1))
    state.set_parsed(parse_tool_calls(text, tool_format))
    return state


def test_whole_body_with_calls_reads_as_an_openai_completion():
    body = chat_body("chatcmpl-1", 0, "m", [_state(block("get_time", {"zone": "UTC"}))], {
        "prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}, None)
    completion = ChatCompletion.model_validate(body)
    message = completion.choices[0].message
    assert message.content is None and completion.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls[0].id.startswith("call_") and message.tool_calls[0].type == "function"
    assert json.loads(message.tool_calls[0].function.arguments) == {"zone": "UTC"}
    plain = chat_body("c", 0, "m", [_state("just text")], {}, None)["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "just text"} and plain["finish_reason"] == "stop"


def test_streamed_call_chunks_accumulate_in_the_openai_client():
    calls = [ToolCall("get_weather", '{"city": "Oslo"}'), ToolCall("get_time", '{"zone": "CET"}')]
    deltas = [{"role": "assistant", "content": ""}, {"content": "Checking."},
              {"tool_calls": [calls[0].delta_dict(0)]}, {"tool_calls": [calls[1].delta_dict(1)]}]
    state = ChatCompletionStreamState()
    for i, delta_body in enumerate(deltas):
        last = i == len(deltas) - 1
        delta = GenerateDelta(finish_reason="stop" if last else None) if i else None
        chunk = chat_chunk("chatcmpl-1", 0, "m", 0, delta_body, delta, None, False, made_tool_calls=i >= 2)
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [(c.id, c.name, c.arguments) for c in calls]
