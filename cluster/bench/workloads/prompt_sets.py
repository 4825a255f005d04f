"""The prompt sets a benchmark can serve, by name, as token ids or as vLLM's client takes them.

- ``edit``: :mod:`cluster.profiling.edit_prompts` (rewrite / summarize / proofread / continue a
  passage given in full);
- ``calibration``: the profiler's chat requests (:mod:`cluster.profiling.calibration`);
- ``code``: HumanEval function completions (:mod:`code_prompts`);
- ``agentic``: tool-calling agent conversations (:mod:`agentic_prompts`);
- ``agentic-long``: fewer of them, 10 turns instead of 4, so their later prompts reach 5-8k
  tokens (:data:`~agentic_prompts.LONG`).

``tandem bench spec`` takes ``--num-prompts`` of a set (cycling it), ``tandem bench paper`` the
whole of ``edit`` and ``calibration`` and :data:`PAPER_NUM_PROMPTS` of the others, and
``tandem bench served`` writes ``code`` and ``agentic`` as vLLM's ``custom`` dataset
(:func:`write_vllm_dataset`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from cluster.bench.workloads.agentic_prompts import DESCRIPTION as AGENTIC
from cluster.bench.workloads.agentic_prompts import DESCRIPTION_LONG as AGENTIC_LONG
from cluster.bench.workloads.agentic_prompts import LONG, AgenticParams, agentic_prompt_texts, load_conversations
from cluster.bench.workloads.code_prompts import DESCRIPTION as CODE
from cluster.bench.workloads.code_prompts import code_messages, human_eval_problems
from cluster.engine.llm import apply_chat_template
from cluster.profiling.calibration import acceptance_prompts
from cluster.profiling.edit_prompts import PASSAGES, build_prompt_ids

EDIT = ("each prompt asks to rewrite, summarize, proofread or continue a short passage given in full "
        "in the prompt, so the output naturally repeats prompt text (where prompt lookup helps)")
CALIBRATION = ("the profiler's calibration chat requests: a few quote text back (where prompt lookup helps), "
               "most are open-ended")
DESCRIPTIONS = {"edit": EDIT, "calibration": CALIBRATION, "code": CODE, "agentic": AGENTIC,
                "agentic-long": AGENTIC_LONG}
VLLM_DATASETS = ("code", "agentic", "agentic-long")  # what tandem bench served writes for vLLM's client
AGENTIC_SETS = {"agentic": AgenticParams(), "agentic-long": LONG}
PAPER_NUM_PROMPTS = 16  # of code and agentic in tandem bench paper (agentic: three conversations and a start)


class PromptIds(NamedTuple):
    prompt_ids: list[list[int]]
    prompt_format: str  # "chat_template" or "plain"


class VllmDataset(NamedTuple):
    """A jsonl file for ``vllm bench serve --dataset-name custom``."""

    path: Path
    skip_chat_template: bool  # the prompts are already rendered: --custom-skip-chat-template
    warm_path: Path | None = None  # the set's other prompts, answered before a cell and never measured


def workload_prompt_ids(name: str, tokenizer, num_prompts: int | None = None,
               announce: Callable[[str], None] = print) -> PromptIds:
    """Token ids of ``num_prompts`` prompts of set ``name`` (default: the whole set, or
    :data:`PAPER_NUM_PROMPTS` of code and agentic), cycling the set where it has fewer."""
    if name == "edit":
        return PromptIds(*build_prompt_ids(tokenizer, num_prompts or len(PASSAGES)))
    if name == "calibration":
        texts = acceptance_prompts(name)
        return PromptIds(*build_prompt_ids(tokenizer, num_prompts or len(texts),
                                           lambda i: [{"role": "user", "content": texts[i % len(texts)]}]))
    num_prompts = num_prompts or PAPER_NUM_PROMPTS
    if name == "code":
        messages = code_messages(human_eval_problems(), num_prompts)
        return PromptIds(*build_prompt_ids(tokenizer, num_prompts, lambda i: messages[i]))
    if name in AGENTIC_SETS:
        texts = agentic_prompt_texts(tokenizer, load_conversations(AGENTIC_SETS[name], announce=announce))
        templated = bool(getattr(tokenizer, "chat_template", None))
        # A template holds any BOS it wants; plain text gets the tokenizer's own (as build_prompt_ids does).
        ids = [tokenizer.encode(texts[i % len(texts)], add_special_tokens=not templated) for i in range(num_prompts)]
        return PromptIds(ids, "chat_template" if templated else "plain")
    raise ValueError(f"unknown prompt set {name!r}; choose one of {', '.join(DESCRIPTIONS)}")


def served_prompt_texts(name: str, tokenizer, announce: Callable[[str], None] = print) -> list[str]:
    """Every prompt of ``code`` or an agentic set as the text a server is sent, chat template applied."""
    if name == "code":
        problems = human_eval_problems()
        return [apply_chat_template(tokenizer, m) for m in code_messages(problems, len(problems))]
    if name in AGENTIC_SETS:
        return agentic_prompt_texts(tokenizer, load_conversations(AGENTIC_SETS[name], announce=announce))
    raise ValueError(f"no served prompt set {name!r}; choose one of {', '.join(VLLM_DATASETS)}")


def write_vllm_dataset(name: str, path: Path, tokenizer, announce: Callable[[str], None] = print,
                       num_warm: int = 0) -> VllmDataset:
    """Write set ``name`` as vLLM's ``custom`` dataset (one ``{"prompt": ...}`` per line). ``code``
    holds the user messages, which vLLM's client puts through the chat template as it does the
    instruction prompts; ``agentic`` holds prompts rendered here (a multi-turn chat with tools is
    no single user message), sent as they are. ``num_warm`` of the set's last prompts go to a file
    of their own (``warm_path``) instead: the client never samples them for a cell."""
    if name == "code":
        problems = human_eval_problems()
        prompts = [m[0]["content"] for m in code_messages(problems, len(problems))]
    elif name in AGENTIC_SETS:
        prompts = agentic_prompt_texts(tokenizer, load_conversations(AGENTIC_SETS[name], announce=announce))
    else:
        raise ValueError(f"no vLLM dataset {name!r}; choose one of {', '.join(VLLM_DATASETS)}")
    if not 0 <= num_warm < len(prompts):
        raise ValueError(f"the {name} set has {len(prompts)} prompts: {num_warm} to warm with leave none to measure")
    measured, warm = prompts[: len(prompts) - num_warm], prompts[len(prompts) - num_warm :]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in measured))
    warm_path = None
    if warm:
        warm_path = path.with_name(f"{path.stem}-warm{path.suffix}")
        warm_path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in warm))
    return VllmDataset(path, skip_chat_template=name in AGENTIC_SETS, warm_path=warm_path)
