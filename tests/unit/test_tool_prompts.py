"""Tools on the way in (cluster/api/tool_request.py, cluster/api/tool_formats.py): the tool
fields' validation (errors name the field), the plan each tool_choice makes, the ``auto``
choice of a format from the chat template, and the prompt of each format, rendered by
``transformers``' ``apply_chat_template`` through templates written here in the manner of
Qwen 2.5's (hermes) and Llama 3.1's (llama3_json), and the embedded SmolLM2's own template
(which knows no tools: the prompt fallback).
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from cluster.api.openai_protocol import ChatCompletionRequest, UnsupportedFieldError
from cluster.api.tool_formats import choose_tool_format, render_chat, tools_instructions
from cluster.models.loader import load_tokenizer, resolve_model
from cluster.models.tiny import TINY_CHAT_TEMPLATE, save_tiny_tokenizer
from cluster.structured.constraint import ConstraintError

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]

# In the manner of Qwen 2.5's template: tools= in the system turn, calls as <tool_call> blocks,
# tool results as a user turn of <tool_response> blocks.
HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are helpful.' }}
Functions you may call:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Answer a call as <tool_call>
{"name": <name>, "arguments": <object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}
{%- elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content }}{% for call in m.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# In the manner of Llama 3.1's: an "ipython" environment and role, one JSON call per turn.
LLAMA_TEMPLATE = """
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
Call a function by answering {"name": <name>, "parameters": <object>}. Functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|eot_id|>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- elif m.role == 'assistant' and m.tool_calls %}
{%- if m.tool_calls | length != 1 %}{{ raise_exception('one call per turn') }}{% endif %}
<|start_header_id|>assistant<|end_header_id|>

{%- set call = m.tool_calls[0].function %}
{"name": "{{ call.name }}", "parameters": {{ call.arguments | tojson }}}<|eom_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": CONVERSATION, **fields})


def template_messages(body: ChatCompletionRequest) -> list[dict]:
    return [m.as_template_message() for m in body.messages]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Format -> a tokenizer whose chat template is of that kind."""
    result = {}
    for name, template in (("hermes", HERMES_TEMPLATE), ("llama3_json", LLAMA_TEMPLATE)):
        path = save_tiny_tokenizer(tmp_path_factory.mktemp(name), chat_template=template)
        result[name] = AutoTokenizer.from_pretrained(path)
    result["prompt"] = load_tokenizer(resolve_model("smollm2-135m-instruct", None))
    return result


# ---- choosing the format -----------------------------------------------------------
def test_auto_reads_the_template(tokenizers):
    for name, tokenizer in tokenizers.items():
        assert choose_tool_format("auto", tokenizer.chat_template) == name
    assert choose_tool_format("auto", TINY_CHAT_TEMPLATE) == "prompt"
    assert choose_tool_format("auto", None) == "prompt"
    assert choose_tool_format("auto", {"default": "{{ x }}", "tool_use": HERMES_TEMPLATE}) == "hermes"
    assert choose_tool_format("llama3_json", HERMES_TEMPLATE) == "llama3_json"  # a setting wins


# ---- rendering ---------------------------------------------------------------------
def test_hermes_prompt_offers_tools_and_replays_the_call_and_its_result(tokenizers):
    body = chat(tools=TOOLS)
    text = render_chat(tokenizers["hermes"], template_messages(body), body.tool_plan("hermes").tools, "hermes")
    assert '"name": "get_weather"' in text and '"description": "Weather now"' in text
    assert '"name": "get_time", "parameters": {"type": "object", "properties": {}}' in text  # filled in
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text  # an object, not a quoted string
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_llama3_json_prompt(tokenizers):
    body = chat(tools=TOOLS)
    text = render_chat(tokenizers["llama3_json"], template_messages(body), body.tool_plan("llama3_json").tools,
                       "llama3_json")
    assert "Environment: ipython" in text and '"name": "get_time"' in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n18 C, sunny<|eot_id|>" in text


def test_a_template_that_refuses_the_messages_is_a_400_on_messages(tokenizers):
    two_calls = [*CONVERSATION[:2], {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]}]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": two_calls})
    with pytest.raises(UnsupportedFieldError) as err:
        render_chat(tokenizers["llama3_json"], template_messages(body), (), "llama3_json")
    assert err.value.param == "messages" and "one call per turn" in str(err.value)


def test_prompt_fallback_writes_tools_calls_and_results_as_text(tokenizers):
    """SmolLM2's template ignores tools= and cannot take a null content; the fallback gives it
    plain string messages."""
    smollm2 = tokenizers["prompt"]
    body = chat(tools=TOOLS, messages=[*CONVERSATION, {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}])
    plan = body.tool_plan("prompt")
    text = render_chat(smollm2, template_messages(body), plan.tools, "prompt")
    instructions = tools_instructions(plan.tools)
    assert f"<|im_start|>system\nBe brief.\n\n{instructions}<|im_end|>" in text
    assert '{"name": "get_weather", "description": "Weather now", "parameters": ' in instructions
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>") in text
    assert ("<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
            "<tool_response>\n12:00\n</tool_response><|im_end|>") in text  # consecutive results merged
    without_system = chat(tools=TOOLS, messages=CONVERSATION[1:2])
    text = render_chat(smollm2, template_messages(without_system), plan.tools, "prompt")
    assert text.startswith(f"<|im_start|>system\n{instructions}<|im_end|>")  # replaces SmolLM's default


def test_tool_choice_none_offers_no_tools(tokenizers):
    for name, tokenizer in tokenizers.items():
        body = chat(tools=TOOLS, tool_choice="none")
        plan = body.tool_plan(name)
        assert plan.tools == () and plan.constraint is None and not plan.parse_calls
        assert "get_time" not in render_chat(tokenizer, template_messages(body), plan.tools, name)


# ---- plans -------------------------------------------------------------------------
def test_plans_of_each_tool_choice():
    auto = chat(tools=TOOLS).tool_plan("hermes")
    assert len(auto.tools) == 2 and auto.constraint is None and auto.parse_calls and auto.max_calls is None
    assert chat(tools=TOOLS, parallel_tool_calls=False).tool_plan("hermes").max_calls == 1
    required = chat(tools=TOOLS, tool_choice="required").tool_plan("hermes")
    assert required.constraint.param == "tool_choice" and "fn_1" in required.constraint.grammar
    assert "call)*" in required.constraint.grammar
    assert "call)*" not in chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False
                                ).tool_plan("hermes").constraint.grammar
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}).tool_plan("prompt")
    assert named.max_calls == 1 and "get_time" in named.constraint.grammar
    assert "get_weather" not in named.constraint.grammar and "call)*" not in named.constraint.grammar
    assert chat().tool_plan("hermes") == chat(tools=[]).tool_plan("hermes")  # no tools


@pytest.mark.parametrize("fields", [
    {"tools": {"type": "function"}}, {"tools": [{"type": "function"}]}, {"tools": [{"type": "retrieval"}]},
    {"tools": [{"type": "function", "function": {"parameters": WEATHER}}]},
    {"tools": [{"type": "function", "function": {"name": ""}}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
    {"tools": TOOLS, "tool_choice": "sometimes"}, {"tools": TOOLS, "tool_choice": {"type": "function"}},
    {"tools": TOOLS, "parallel_tool_calls": "no"},
])
def test_bad_tool_shapes_are_validation_errors_at_the_field(fields):
    with pytest.raises(ValidationError) as err:
        chat(**fields)
    assert err.value.errors()[0]["loc"][0] in fields


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "auto"}, "tool_choice"),  # without tools
    ({"tools": [], "tool_choice": "none"}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),  # a name twice
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_date"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/nowhere"}}}}}]}, "tools"),
])
def test_inconsistent_tool_fields_name_the_field(fields, param):
    with pytest.raises((UnsupportedFieldError, ConstraintError)) as err:
        chat(**fields).tool_plan("hermes")
    assert err.value.param == param, err.value


@pytest.mark.parametrize("message", [
    {"role": "tool", "content": "result"},  # no tool_call_id
    {"role": "user", "content": "hi", "tool_calls": [CALL]},
    {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]},
])
def test_bad_tool_messages_are_validation_errors_at_messages(message):
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [message]})
    assert err.value.errors()[0]["loc"][0] == "messages"


def test_template_messages_keep_the_tool_fields():
    messages = template_messages(chat())
    assert messages[2] == {"role": "assistant", "content": "", "tool_calls": [CALL]}
    assert messages[3] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}
    assert json.loads(messages[2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_continuing_the_assistants_message_renders_as_transformers_does(tokenizers):
    """continue_final_message / add_generation_prompt / chat_template_kwargs reach the template."""
    smollm2 = tokenizers["prompt"]
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    body = chat(messages=messages, add_generation_prompt=False, continue_final_message=True)
    body.check_supported()
    text = render_chat(smollm2, template_messages(body), (), "prompt", body.template_options())
    assert text == smollm2.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("The colour is")  # no end of turn after the partial answer
    plain = chat(messages=messages[:1])
    assert render_chat(smollm2, template_messages(plain), (), "prompt", plain.template_options()) == \
        smollm2.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    no_prompt = chat(messages=messages[:1], add_generation_prompt=False)
    assert not render_chat(smollm2, template_messages(no_prompt), (), "prompt",
                           no_prompt.template_options()).endswith("<|im_start|>assistant\n")


def test_chat_template_kwargs_are_the_templates_variables(tokenizers):
    class Recording:
        chat_template = "x"

        def apply_chat_template(self, messages, **kwargs):
            self.kwargs = kwargs
            return "rendered"

    tokenizer = Recording()
    body = chat(messages=CONVERSATION[:2], chat_template_kwargs={"enable_thinking": False})
    render_chat(tokenizer, template_messages(body), (), "hermes", body.template_options())
    assert tokenizer.kwargs == {"tools": None, "tokenize": False, "enable_thinking": False,
                                "add_generation_prompt": True, "continue_final_message": False}
