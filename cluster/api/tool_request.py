"""The tool fields of a chat request (``tools``, ``tool_choice``, ``parallel_tool_calls``)
and what they ask of the prompt, the sampler and the response: a ``ToolPlan``.

- ``tools``: a list of ``{"type": "function", "function": {"name", "description"?,
  "parameters"?, "strict"?}}``; names are unique; ``parameters`` is a JSON schema (missing:
  no arguments, ``{"type": "object", "properties": {}}``) that llguidance must compile. An
  empty list is the same as no tools.
- ``tool_choice``: "none" (the tools are not put in the prompt, nothing is parsed), "auto"
  (the default: tools offered, calls parsed out of free text), "required" (at least one
  call) or ``{"type": "function", "function": {"name": ...}}`` (exactly that call). The last
  two are forced by a grammar (``tool_calls.forced_call_grammar``), so their calls always
  parse and their arguments match the parameters schema.
- ``parallel_tool_calls`` false: at most one call (forced calls: exactly one).

Bad input raises UnsupportedFieldError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from cluster.api.errors import UnsupportedFieldError
from cluster.api.tool_calls import forced_call_grammar
from cluster.structured.constraint import ConstraintError, StructuredOutputs

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionSpec(_Body):
    name: StrictStr = Field(min_length=1, max_length=64)
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec

    def template_dict(self) -> dict:
        """The OpenAI shape chat templates take as ``tools=``, parameters filled in."""
        function = {"name": self.function.name}
        if self.function.description:
            function["description"] = self.function.description
        function["parameters"] = self.function.parameters or EMPTY_PARAMETERS
        return {"type": "function", "function": function}


class FunctionName(_Body):
    name: StrictStr


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """What the tool fields ask for. ``tools`` go into the prompt (empty: none offered);
    ``constraint`` forces calls (None: free text); ``parse_calls``: look for calls in the
    output; ``max_calls`` caps parsed calls (None: any number)."""

    tools: tuple[dict, ...] = ()
    constraint: StructuredOutputs | None = None
    parse_calls: bool = False
    max_calls: int | None = None


NO_TOOLS = ToolPlan()


def plan_tools(tools: list[ToolSpec] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool,
               tool_format: str) -> ToolPlan:
    """Validate the tool fields against each other and build the plan (raises UnsupportedFieldError
    or ConstraintError naming ``tools`` or ``tool_choice``)."""
    if not tools:
        if tool_choice is not None:
            raise UnsupportedFieldError("tool_choice", "tool_choice is only allowed when tools are given")
        return NO_TOOLS
    names = [tool.function.name for tool in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise UnsupportedFieldError("tools", f"tools[{i}].function.name {name!r} is given twice")
    for i, tool in enumerate(tools):
        _check_parameters(i, tool.function.parameters)
    if tool_choice is None:
        tool_choice = "auto"
    if tool_choice == "none":
        return NO_TOOLS
    offered = tuple(tool.template_dict() for tool in tools)
    parameters = {tool.function.name: tool.function.parameters or EMPTY_PARAMETERS for tool in tools}
    one_call = not parallel_tool_calls
    if tool_choice == "auto":
        return ToolPlan(offered, None, True, 1 if one_call else None)
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in parameters:
            raise UnsupportedFieldError("tool_choice", f"tool_choice names the function {name!r}, which is not in "
                                                       f"tools ({', '.join(names)})")
        parameters, one_call = {name: parameters[name]}, True
    grammar = forced_call_grammar(parameters, tool_format, several=not one_call)
    constraint = StructuredOutputs(grammar=grammar, param="tool_choice")
    return ToolPlan(offered, constraint, True, 1 if one_call else None)


def _check_parameters(index: int, parameters: dict | None) -> None:
    if parameters is None:
        return
    where = f"tools[{index}].function.parameters"
    if parameters.get("type", "object") != "object":
        raise UnsupportedFieldError("tools", f"{where} must be a JSON schema of type object (the arguments "
                                             f"are a JSON object), got type {parameters.get('type')!r}")
    try:
        StructuredOutputs(json=parameters, param="tools")
    except ConstraintError as err:
        raise UnsupportedFieldError("tools", f"{where}: {str(err).removeprefix('tools: ')}") from None
