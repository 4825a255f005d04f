"""The ``agentic`` workload: tool-calling agent conversations, as an agent sends them.

A conversation is a system prompt (:data:`~agentic_tools.SYSTEM_PROMPT`) with four tools
offered (``read_file``, ``search_code``, ``run_tests``, ``edit_file``: JSON schemas,
:data:`~agentic_tools.TOOLS`), a user task (fix the bug put into one HumanEval function of a
made repository, :mod:`agentic_tools`), then ``num_turns`` rounds of an assistant turn that
calls one tool and the tool's result fed back (file contents, search hits, pytest's report, an
edit's outcome: hundreds of tokens each, made from the files). Which tool each turn calls
follows one of :data:`PLANS` (run the tests, read, search, edit, run again), as an agent loop
that names the tool (``tool_choice`` naming the function) does; left to choose, the small
model called ``run_tests`` in 80 of 96 turns. Every benchmark prompt is a prefix of a
conversation that ends where the assistant speaks next: before each assistant turn, and after
the last result, so ``num_turns + 1`` prompts per conversation, conversation after
conversation. Later prompts of a conversation repeat everything before them (the schemas,
earlier results, earlier calls), and results quote the same files again.

The assistant turns are the model's own: SmolLM2-135M-Instruct in float32 on Tandem's engine
(:class:`~cluster.engine.llm.LLM`), greedy, at most ``max_tokens`` tokens, every conversation
of a turn in one batch (after one request that puts the shared system prompt in the prefix
cache), the tools rendered into the chat template as Tandem's chat endpoint renders them
(:func:`~cluster.api.tool_formats.render_chat`) and the call to the plan's tool forced as a
``tool_choice`` naming it forces it (:func:`~cluster.api.tool_request.plan_tools`): the
arguments are the model's. A call cut off by ``max_tokens`` stays as the assistant's text and
the next message is the user's :data:`CUT_OFF` instead of a result. The history holds a parsed
call as an agent sends it back (``tool_calls``, arguments as JSON text). Targets, plans and
task wording come from ``random.Random(seed)``; the conversations are made once and kept as
JSON under ``<cache dir>/bench/agentic-<key>.json``, the key a hash of :class:`AgenticParams`,
the tools and the prompts' text, so a second run reads them. A benchmark of another model
renders the same conversations (SmolLM2's turns) with that model's tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

from cluster.api.tool_calls import parse_tool_calls
from cluster.api.tool_formats import choose_tool_format, prompt_messages, render_chat
from cluster.api.tool_request import NamedToolChoice, ToolSpec, plan_tools
from cluster.bench.workloads import agentic_tools
from cluster.bench.workloads.agentic_tools import SYSTEM_PROMPT, TOOLS, Workspace, module_of
from cluster.bench.workloads.code_prompts import VERSION as HUMAN_EVAL_VERSION
from cluster.bench.workloads.code_prompts import HumanEvalProblem, human_eval_problems
from cluster.engine.llm import LLM
from cluster.shared.cache_dir import default_cache_dir
from cluster.shared.sampling_params import SamplingParams

FORMAT_VERSION = 2  # bump when the made conversations change for the same parameters
DESCRIPTION = ("each prompt is a tool-calling agent's conversation up to the assistant's next turn: tool schemas, "
               "a bug-fix task, earlier tool calls (SmolLM2's own) and long tool results, repeated turn after turn")
CUT_OFF = "Your last message was not one complete tool call. Answer with exactly one tool call."
TASKS = (
    "The test tests/test_{module}.py::test_{entry} fails. Find the bug in {entry} (lib/{module}.py) and fix it, "
    "then run the tests again.",
    "{entry} in lib/{module}.py returns wrong results for some inputs; its docstring says what it should do. "
    "Fix it and make sure tests/test_{module}.py passes.",
    "CI is red since the last change to lib/{module}.py. Run the tests, find what broke and fix it with the "
    "smallest change you can.",
)
PLANS = (  # the tool of each turn, cycled beyond four
    ("run_tests", "read_file", "edit_file", "run_tests"),
    ("search_code", "read_file", "edit_file", "run_tests"),
    ("read_file", "run_tests", "edit_file", "read_file"),
    ("run_tests", "search_code", "read_file", "edit_file"),
)

DESCRIPTION_LONG = ("the agentic conversations run 10 turns instead of 4: later prompts carry ten "
                    "tool results, whole source files among them, and reach 5-8k tokens")

# (conversations, the tool each must call) -> the assistant's next output text of each
GenerateFn = Callable[[list[list[dict]], list[str]], list[str]]


@dataclass(frozen=True)
class AgenticParams:
    num_conversations: int = 24
    num_turns: int = 4
    max_tokens: int = 96  # per assistant turn
    seed: int = 0
    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"  # native on every CPU (bfloat16 is emulated on AVX2, many times slower)

    def key(self) -> str:
        """A hash of everything the made conversations depend on."""
        what = {**asdict(self), "format": FORMAT_VERSION, "human_eval": HUMAN_EVAL_VERSION, "tools": TOOLS,
                "system": SYSTEM_PROMPT, "tasks": TASKS, "plans": PLANS, "cut_off": CUT_OFF,
                "mutations": agentic_tools.MUTATIONS,
                "per_module": agentic_tools.PROBLEMS_PER_MODULE}
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


LONG = AgenticParams(num_conversations=8, num_turns=10)  # the ``agentic-long`` set


class AgentConversation(NamedTuple):
    task_id: str  # the HumanEval problem the bug is in
    messages: list[dict]  # OpenAI chat messages, system first
    outputs: list[str]  # the assistant's raw output text of each turn


def build_conversations(problems: list[HumanEvalProblem], generate: GenerateFn, num_conversations: int,
                        num_turns: int, seed: int, tool_format: str = "prompt") -> list[AgentConversation]:
    """``num_conversations`` conversations of ``num_turns`` assistant turns each, every turn of
    every conversation asked of ``generate`` at once. Deterministic for a seed and a
    deterministic ``generate``."""
    if not 1 <= num_conversations <= len(problems):
        raise ValueError(f"num_conversations must be 1..{len(problems)} (one target problem each), "
                         f"got {num_conversations}")
    rng = random.Random(seed)
    targets = rng.sample(range(len(problems)), num_conversations)
    workspaces = [Workspace(problems, target) for target in targets]
    messages, plans = [], []
    for target in targets:
        task = rng.choice(TASKS).format(module=module_of(target), entry=problems[target].entry_point)
        messages.append([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task}])
        plans.append(rng.choice(PLANS))
    outputs: list[list[str]] = [[] for _ in targets]
    for turn in range(num_turns):
        texts = generate([list(m) for m in messages], [plan[turn % len(plan)] for plan in plans])
        if len(texts) != len(messages):
            raise ValueError(f"the generator answered {len(texts)} of {len(messages)} conversations")
        for c, text in enumerate(texts):
            outputs[c].append(text)
            messages[c].extend(_turn(text, workspaces[c], f"call_{c}_{turn}", tool_format))
    return [AgentConversation(problems[t].task_id, m, o) for t, m, o in zip(targets, messages, outputs)]


def _turn(text: str, workspace: Workspace, call_id: str, tool_format: str) -> list[dict]:
    """The assistant message of output ``text`` and what is fed back after it."""
    parsed = parse_tool_calls(text, tool_format, max_calls=1)
    if not parsed.calls:
        return [{"role": "assistant", "content": text}, {"role": "user", "content": CUT_OFF}]
    call = parsed.calls[0]
    assistant = {"role": "assistant", "content": parsed.content or None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}
    result = workspace.call(call.name, json.loads(call.arguments))
    return [assistant, {"role": "tool", "tool_call_id": call_id, "content": result}]


def conversation_prefixes(messages: list[dict]) -> list[list[dict]]:
    """Every prefix of ``messages`` that ends where the assistant speaks next: before each
    assistant message, and the whole conversation (when it does not end with the assistant)."""
    ends = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not messages or messages[-1]["role"] != "assistant":
        ends.append(len(messages))
    return [messages[:end] for end in ends]


def offered_tools() -> tuple[dict, ...]:
    """:data:`TOOLS` as a chat request's ``tools`` reach the chat template."""
    return tuple(ToolSpec.model_validate(tool).template_dict() for tool in TOOLS)


def render_prompt(tokenizer, messages: list[dict]) -> str:
    """The prompt text of ``messages`` with the tools offered: the chat template as Tandem's chat
    endpoint renders it, or for a tokenizer without a template plain ``Role: ...`` text of the
    same messages (tools in the system message, as for a template that knows none)."""
    if getattr(tokenizer, "chat_template", None):
        return render_chat(tokenizer, messages, offered_tools(), choose_tool_format("auto", tokenizer.chat_template))
    plain = prompt_messages(messages, offered_tools())
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in plain) + "Assistant:"


def agentic_prompt_texts(tokenizer, conversations: list[AgentConversation]) -> list[str]:
    """Every conversation's prefixes (:func:`conversation_prefixes`) rendered, conversation after conversation."""
    return [render_prompt(tokenizer, prefix)
            for conv in conversations for prefix in conversation_prefixes(conv.messages)]


def engine_generator(llm: LLM, tool_format: str, max_tokens: int) -> GenerateFn:
    """Greedy generation on Tandem's engine with a call to the given tool forced, as a chat
    request with ``tools`` and a ``tool_choice`` naming the function asks of it. The first
    conversation's prompt is prefilled alone first, so that the others find the system prompt
    and the tools (the same in all) in the prefix cache instead of computing them again."""
    specs = [ToolSpec.model_validate(t) for t in TOOLS]
    params = {}
    for tool in specs:
        choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": tool.function.name}})
        plan = plan_tools(specs, choice, False, tool_format)
        params[tool.function.name] = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                    structured_outputs=plan.constraint)

    def generate(conversations: list[list[dict]], tool_names: list[str]) -> list[str]:
        prompts = [llm.tokenizer.encode(render_chat(llm.tokenizer, m, offered_tools(), tool_format),
                                        add_special_tokens=False) for m in conversations]
        llm.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0.0))
        return [out.outputs[0].text for out in llm.generate(prompts, [params[name] for name in tool_names])]

    return generate


def load_conversations(params: AgenticParams = AgenticParams(), cache_dir: Path | None = None,
                       announce: Callable[[str], None] = print) -> list[AgentConversation]:
    """The conversations of ``params``: read from the cache, or made (HumanEval fetched, the
    model loaded) and cached first."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache_dir / "bench" / f"agentic-{params.key()}.json"
    if path.is_file():
        return [AgentConversation(**c) for c in json.loads(path.read_text())["conversations"]]
    problems = human_eval_problems(cache_dir)
    announce(f"making the agentic conversations once ({params.num_conversations} x {params.num_turns} turns, "
             f"{params.model} {params.dtype}); they are kept in {path}")
    started = time.perf_counter()
    llm = LLM(params.model, dtype=params.dtype, max_num_seqs=params.num_conversations, kv_cache_memory="2GiB")
    try:
        tool_format = choose_tool_format("auto", llm.tokenizer.chat_template)
        generate = engine_generator(llm, tool_format, params.max_tokens)

        def generate_turn(conversations: list[list[dict]], tool_names: list[str]) -> list[str]:
            turn = sum(m["role"] == "assistant" for m in conversations[0]) + 1
            announce(f"  turn {turn}/{params.num_turns}: {len(conversations)} conversations")
            return generate(conversations, tool_names)

        conversations = build_conversations(problems, generate_turn, params.num_conversations, params.num_turns,
                                            params.seed, tool_format)
    finally:
        llm.engine.worker.close()
    seconds = time.perf_counter() - started
    announce(f"made {len(conversations)} conversations in {seconds:.0f} s")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"params": asdict(params), "tool_format": tool_format, "seconds": seconds,
                               "conversations": [c._asdict() for c in conversations]}, indent=1))
    os.replace(tmp, path)  # atomic: a half-written file never has the final name
    return conversations
