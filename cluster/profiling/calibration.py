"""Prompt sets acceptance is measured on (``tandem profile --acceptance-prompts``).

``calibration``: chat requests of the kinds users send, some that quote text back (where
prompt lookup shines) and some open-ended. ``edit``: ``tandem bench spec``'s requests to
rewrite, summarize, proofread or continue a passage given in full (RAG answers, code and
document edits), where lookup copies far more. Acceptance depends on the workload, so the
paper profiled per dataset; a profile records which set it was measured on.
"""

from __future__ import annotations

from cluster.profiling.edit_prompts import PASSAGES, prompt_messages

CALIBRATION_PROMPTS = [
    "Summarize this in one sentence: The library opens at nine in the morning and closes at six in the "
    "evening. On Saturdays it closes at noon, and on Sundays it is closed all day.",
    "Fix the spelling in this sentence and repeat it: Teh quick brown fox jumpd over the lazzy dog.",
    "Write a Python function that returns the factorial of n, then show how to call it for n = 5.",
    "Explain in three short sentences why the sky is blue.",
    "Translate into plain English: The meeting has been postponed until further notice due to "
    "unforeseen circumstances.",
    "List five fruits that are red, one per line.",
    "Continue the list: Monday, Tuesday, Wednesday,",
    "Rewrite this more politely: Send me the report now.",
    "What are the first ten prime numbers?",
    "Give a two-sentence description of a lighthouse at night.",
    "Convert this list to a numbered list: apples, pears, plums, cherries, grapes.",
    "Write a haiku about autumn leaves.",
]


ACCEPTANCE_PROMPT_SETS = ("calibration", "edit")


def acceptance_prompts(name: str) -> list[str]:
    """The user messages of prompt set ``name`` (one of :data:`ACCEPTANCE_PROMPT_SETS`)."""
    if name == "calibration":
        return list(CALIBRATION_PROMPTS)
    if name == "edit":
        return [prompt_messages(i)[0]["content"] for i in range(len(PASSAGES))]
    raise ValueError(f"unknown acceptance prompt set {name!r}; choose one of {', '.join(ACCEPTANCE_PROMPT_SETS)}")
