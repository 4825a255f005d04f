"""How a model sees tools: choosing its tool-call format, and rendering a chat (tools, past
calls, tool results) into its prompt.

Formats (``ModelConfig.tool_call_format``):

- ``hermes``: the chat template takes ``tools=`` and past calls as ``tool_calls`` (Qwen 2.5,
  Hermes); the model answers with ``<tool_call>`` blocks.
- ``llama3_json``: the chat template takes ``tools=`` (Llama 3.1/3.2/3.3); a call is a JSON
  object with ``name`` and ``parameters``.
- ``prompt``: the template knows no tools. Tandem writes the tools into the system prompt
  (``tools_instructions``) and asks for ``<tool_call>`` blocks; past calls become that text in
  the assistant turn and tool results a user turn of ``<tool_response>`` blocks, so the
  template sees only plain string messages.

``auto`` reads the template's text (``choose_tool_format``): ``<tool_call>`` in it means
hermes; else ``ipython`` or ``<|python_tag|>`` (Llama 3.1's tool role and tag) means
llama3_json; anything else is ``prompt``.
"""

from __future__ import annotations

import json

from jinja2 import TemplateError

from cluster.api.errors import UnsupportedFieldError
from cluster.api.tool_calls import CLOSE, OPEN

TOOL_FORMATS = ("hermes", "llama3_json", "prompt")


def choose_tool_format(setting: str, chat_template: str | dict | None) -> str:
    """The format to use: ``setting`` unless it is ``auto``, then by the rule above."""
    if setting != "auto":
        return setting
    if isinstance(chat_template, dict):  # several named templates (e.g. "default" and "tool_use")
        chat_template = "\n".join(str(text) for text in chat_template.values())
    text = chat_template or ""
    if OPEN in text:
        return "hermes"
    if "ipython" in text or "<|python_tag|>" in text:
        return "llama3_json"
    return "prompt"


def render_chat(tokenizer, messages: list[dict], tools: tuple[dict, ...], tool_format: str,
                options: dict | None = None) -> str:
    """The prompt text of ``messages`` (OpenAI message dicts: role, content, and tool_calls /
    tool_call_id where set) with ``tools`` offered (empty: none). ``options``: more arguments of
    ``apply_chat_template`` (default: ``add_generation_prompt=True``). A template that raises on
    the messages is a 400 naming ``messages``."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise UnsupportedFieldError("messages", "this model has no chat template; use /v1/completions")
    if tool_format == "prompt":
        messages, tools_arg = prompt_messages(messages, tools), None
    else:
        messages, tools_arg = [_template_message(m) for m in messages], list(tools) or None
    options = {"add_generation_prompt": True, **(options or {})}
    try:
        return tokenizer.apply_chat_template(messages, tools=tools_arg, tokenize=False, **options)
    except (TemplateError, ValueError) as err:
        raise UnsupportedFieldError("messages", f"the model's chat template refused these messages: {err}") from None


def _template_message(message: dict) -> dict:
    """For templates that take tools: the arguments of past calls as objects, which is what
    Qwen's and Llama's templates serialize (a JSON string would be quoted twice)."""
    if not message.get("tool_calls"):
        return message
    calls = [{**call, "function": {**call["function"], "arguments": _arguments(call["function"]["arguments"])}}
             for call in message["tool_calls"]]
    return {**message, "tool_calls": calls}


# ---- the prompt fallback ------------------------------------------------------------
def tools_instructions(tools: tuple[dict, ...]) -> str:
    """The system-prompt text that offers ``tools`` (OpenAI tool dicts) to a model whose template
    knows none."""
    signatures = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return ("You can call functions. Their signatures:\n"
            f"<tools>\n{signatures}\n</tools>\n"
            "To call one, answer with a block per call:\n"
            f'{OPEN}\n{{"name": <name>, "arguments": <JSON object>}}\n{CLOSE}')


def prompt_messages(messages: list[dict], tools: tuple[dict, ...]) -> list[dict]:
    """Plain ``{"role", "content": str}`` messages: the tools appended to the system message (one
    is added first when there is none), past calls written as blocks, consecutive tool results
    merged into one user message of ``<tool_response>`` blocks."""
    out: list[dict] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
            continue
        if role == "assistant" and message.get("tool_calls"):
            blocks = [f"{OPEN}\n{_call_text(call['function'])}\n{CLOSE}" for call in message["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        out.append({"role": role, "content": content})
    if tools:
        instructions = tools_instructions(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{instructions}" if out[0]["content"] else instructions
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _call_text(function: dict) -> str:
    return json.dumps({"name": function["name"], "arguments": _arguments(function["arguments"])},
                      ensure_ascii=False)


def _arguments(arguments):
    """A past call's arguments (a JSON string, as OpenAI sends them) as an object when they decode."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments
