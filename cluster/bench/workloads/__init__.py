"""Prompt sets of the benchmarks beyond the shipped instruction and edit prompts: ``code``
(HumanEval completions) and ``agentic`` (tool-calling agent conversations); :mod:`prompt_sets`
hands any set to ``tandem bench spec``, ``paper`` and ``served``."""
