"""The tools of the ``agentic`` workload and the repository they act on, all made text.

A conversation's repository is a slice of HumanEval (:mod:`code_prompts`) laid out as a
small Python project: the :data:`PROBLEMS_PER_REPO` consecutive problems around its target,
``lib/part_NN.py`` holding :data:`PROBLEMS_PER_MODULE` of them (their imports at the top, then
each prompt followed by its canonical solution) and ``tests/test_part_NN.py`` their checks as
pytest tests. Its :class:`Workspace` puts one bug into the target function (the first of
:data:`MUTATIONS` its solution holds).
Nothing runs: every tool result is text made from the files, deterministically. A path that
is not in the repository is taken as the closest one that is (``difflib``), with a line that
says so, as a forgiving harness would:

- ``read_file``: the file's lines numbered as ``cat -n`` does;
- ``search_code``: ``path:line:text`` of every line holding the query (case-insensitive);
- ``run_tests``: pytest's report of the whole suite, one file or a module's test file; the
  target's test fails, with its traceback, while the bug is in the file;
- ``edit_file``: replace the first occurrence of ``old_text``, then show the changed lines
  (or the whole file when ``old_text`` is not there).
"""

from __future__ import annotations

import difflib
import zlib
from dataclasses import dataclass, field

from cluster.bench.workloads.code_prompts import HumanEvalProblem

PROBLEMS_PER_MODULE = 2
PROBLEMS_PER_REPO = 12  # six modules
MAX_SEARCH_LINES = 16

SYSTEM_PROMPT = ("You are a coding agent in a Python repository: lib/ holds the code and tests/ its pytest tests. "
                 "Work in steps: call exactly one tool per turn, read its result, then decide the next step. "
                 "Do not guess what a file holds; read it.")

_PATH = {"type": "string", "description": "a path relative to the repository root, e.g. lib/part_03.py",
         "pattern": "^(lib|tests)/[a-z0-9_]+\\.py$", "maxLength": 32}
TOOLS: tuple[dict, ...] = (
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository; its lines come back numbered.",
        "parameters": {"type": "object", "properties": {"path": _PATH}, "required": ["path"],
                       "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_code",
        "description": "Find the lines of the repository that contain a text (case-insensitive), as path:line:text.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "the text to look for", "maxLength": 24},
            "path": {**_PATH, "description": "only search this file (default: every file)"}},
            "required": ["query"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "run_tests",
        "description": "Run the tests with pytest: every test, one test file, or the tests of one lib/ module.",
        "parameters": {"type": "object", "properties": {
            "path": {**_PATH, "description": "a test file or a lib/ module (default: the whole suite)"}},
            "required": [], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "edit_file",
        "description": "Replace the first occurrence of old_text in a file with new_text.",
        "parameters": {"type": "object", "properties": {
            "path": _PATH,
            "old_text": {"type": "string", "description": "text of the file to replace, exactly", "maxLength": 60},
            "new_text": {"type": "string", "description": "the text to put in its place", "maxLength": 60}},
            "required": ["path", "old_text", "new_text"], "additionalProperties": False}}},
)

# (text in a solution, what the bug makes of it): the first one a target's solution holds is applied once.
MUTATIONS = ((" <= ", " < "), (" >= ", " > "), (" < ", " <= "), (" > ", " >= "), (" == ", " != "),
             (" != ", " == "), ("+ 1", "+ 2"), ("- 1", "+ 1"), ("True", "False"), ("False", "True"),
             (" + ", " - "), (" * ", " + "), ("[::-1]", "[::1]"), ("return ", "return not "))


def module_of(index: int) -> str:
    """The module holding problem ``index``, e.g. ``part_03``."""
    return f"part_{index // PROBLEMS_PER_MODULE:02d}"


def _function_text(problem: HumanEvalProblem, solution: str) -> str:
    body = [line for line in problem.prompt.strip("\n").splitlines() if not line.startswith(("from ", "import "))]
    return "\n".join(body).strip("\n") + "\n" + solution.rstrip() + "\n"


def _imports(problems: list[HumanEvalProblem]) -> list[str]:
    seen: dict[str, None] = {}
    for problem in problems:
        for line in problem.prompt.splitlines():
            if line.startswith(("from ", "import ")):
                seen[line.strip()] = None
    return list(seen)


def _module_text(problems: list[HumanEvalProblem], solutions: list[str]) -> str:
    head = "\n".join(_imports(problems))
    functions = "\n\n".join(_function_text(p, s) for p, s in zip(problems, solutions))
    return f"{head}\n\n\n{functions}" if head else functions


def _test_text(module: str, problems: list[HumanEvalProblem]) -> str:
    names = ", ".join(p.entry_point for p in problems)
    parts = [f"from lib.{module} import {names}\n"]
    for p in problems:
        check = p.test[p.test.find("def check(candidate):"):].rstrip()
        check = check.replace("def check(candidate):", f"def check_{p.entry_point}(candidate):", 1)
        parts.append(f"{check}\n\n\ndef test_{p.entry_point}():\n    check_{p.entry_point}({p.entry_point})\n")
    return "\n\n".join(parts)


def mutate(solution: str) -> str:
    """``solution`` with one bug: the first of :data:`MUTATIONS` it holds, applied once."""
    for old, new in MUTATIONS:
        if old in solution:
            return solution.replace(old, new, 1)
    return solution.rstrip() + "\n    return None\n"


def repository(problems: list[HumanEvalProblem], bug_in: int | None = None) -> dict[str, str]:
    """Path -> text of the repository around problem ``bug_in`` (its :data:`PROBLEMS_PER_REPO`
    slice of ``problems``; without ``bug_in``, every problem), that problem's solution carrying
    :func:`mutate`'s bug."""
    files = {}
    first, last = 0, len(problems)
    if bug_in is not None:
        first = bug_in // PROBLEMS_PER_REPO * PROBLEMS_PER_REPO
        last = min(first + PROBLEMS_PER_REPO, len(problems))
    for start in range(first, last, PROBLEMS_PER_MODULE):
        group = problems[start:min(start + PROBLEMS_PER_MODULE, last)]
        module = module_of(start)
        solutions = [mutate(p.canonical_solution) if start + i == bug_in else p.canonical_solution
                     for i, p in enumerate(group)]
        files[f"lib/{module}.py"] = _module_text(group, solutions)
        files[f"tests/test_{module}.py"] = _test_text(module, group)
    return files


def numbered(text: str, first: int = 1, last: int | None = None) -> str:
    lines = text.splitlines()
    last = len(lines) if last is None else min(last, len(lines))
    return "\n".join(f"{n:6d}\t{lines[n - 1]}" for n in range(max(first, 1), last + 1))


@dataclass
class Workspace:
    """One conversation's repository: ``files`` (edits change them) with a bug in ``target``."""

    problems: list[HumanEvalProblem]
    target: int  # index into problems
    files: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.files = repository(self.problems, bug_in=self.target)
        self._correct = _function_text(self.problems[self.target], self.problems[self.target].canonical_solution)

    @property
    def target_problem(self) -> HumanEvalProblem:
        return self.problems[self.target]

    @property
    def target_module(self) -> str:
        return module_of(self.target)

    def call(self, name: str, arguments: dict) -> str:
        """The result of tool ``name`` called with ``arguments`` (an unknown tool: an error line)."""
        text = {k: v if isinstance(v, str) else str(v) for k, v in arguments.items()}
        note, path = "", text.get("path", "")
        if path and path not in self.files and path.rstrip("/") not in ("lib", "tests", "."):
            note, path = self._closest(path)
        if name == "read_file":
            return note + self._read(path)
        if name == "search_code":
            return note + self._search(text.get("query", ""), path)
        if name == "run_tests":
            return note + self._run_tests(path)
        if name == "edit_file":
            return note + self._edit(path, text.get("old_text", ""), text.get("new_text", ""))
        return f"error: no tool named {name!r}; the tools are {', '.join(t['function']['name'] for t in TOOLS)}"

    def _closest(self, path: str) -> tuple[str, str]:
        """A line saying which path stands for ``path``, and that path."""
        closest = difflib.get_close_matches(path, sorted(self.files), n=1, cutoff=0.0)[0]
        return f"note: no such path {path!r}; using the closest, {closest}\n", closest

    def _listing(self) -> str:
        return "\n".join(sorted(self.files))

    def _read(self, path: str) -> str:
        if path not in self.files:
            return f"error: read_file needs a file; the repository's files:\n{self._listing()}"
        return numbered(self.files[path])

    def _search(self, query: str, path: str) -> str:
        path = path if path in self.files else ""
        needle = query.lower()
        hits = [f"{p}:{n}:{line}" for p in ([path] if path else sorted(self.files)) if needle
                for n, line in enumerate(self.files[p].splitlines(), 1) if needle in line.lower()]
        if not hits:
            return f"no matches for {query!r}; the repository's files:\n{self._listing()}"
        more = f"\n... {len(hits) - MAX_SEARCH_LINES} more matches" if len(hits) > MAX_SEARCH_LINES else ""
        return "\n".join(hits[:MAX_SEARCH_LINES]) + more

    def _edit(self, path: str, old_text: str, new_text: str) -> str:
        if path not in self.files:
            return f"error: edit_file needs a file; nothing changed. The repository's files:\n{self._listing()}"
        text = self.files[path]
        if not old_text or old_text not in text:
            return f"error: old_text was not found in {path}; nothing changed. The file reads:\n{numbered(text)}"
        start = text[:text.index(old_text)].count("\n") + 1
        self.files[path] = text.replace(old_text, new_text, 1)
        first = max(1, start - 5)
        last = min(start + new_text.count("\n") + 5, len(self.files[path].splitlines()))
        return f"edited {path}; lines {first}-{last} now read:\n{numbered(self.files[path], first, last)}"

    def _run_tests(self, path: str) -> str:
        tests = sorted(p for p in self.files if p.startswith("tests/"))
        if path.startswith("lib/"):
            path = f"tests/test_{path.removeprefix('lib/')}"
        chosen = [path] if path in self.files and path.startswith("tests/") else tests
        failing = f"tests/test_{self.target_module}.py"
        broken = self._correct not in self.files[f"lib/{self.target_module}.py"]
        lines = ["============================= test session starts ==============================",
                 "platform linux -- Python 3.11.9, pytest-8.3.3, pluggy-1.5.0",
                 "rootdir: /workspace", f"collected {sum(self._num_tests(t) for t in chosen)} items", ""]
        for i, test in enumerate(chosen, 1):
            marks = "".join("F" if broken and test == failing and j == self._target_position() else "."
                            for j in range(self._num_tests(test)))
            lines.append(f"{test} {marks}".ljust(72) + f" [{100 * i // len(chosen):3d}%]")
        total = sum(self._num_tests(t) for t in chosen)
        if broken and failing in chosen:
            lines += ["", self._failure(failing), "=========================== short test summary info "
                      "============================",
                      f"FAILED {failing}::test_{self.target_problem.entry_point} - AssertionError",
                      f"========================= 1 failed, {total - 1} passed in {0.02 * total:.2f}s "
                      "========================="]
        else:
            lines += ["", f"============================== {total} passed in {0.02 * total:.2f}s "
                          "=============================="]
        return "\n".join(lines)

    def _num_tests(self, test_path: str) -> int:
        return self.files[test_path].count("\ndef test_")

    def _target_position(self) -> int:
        return self.target % PROBLEMS_PER_MODULE

    def _failure(self, test_path: str) -> str:
        entry = self.target_problem.entry_point
        source = self.files[test_path].splitlines()
        check_at = source.index(f"def check_{entry}(candidate):")
        asserts = [n for n in range(check_at + 1, len(source)) if source[n].strip().startswith("assert")]
        fail_at = asserts[0] if asserts else check_at
        call_at = source.index(f"def test_{entry}():") + 1
        check = [f"    {line}" for line in source[check_at:fail_at]]
        title = f" test_{entry} ".center(80, "_")
        return "\n".join(["=================================== FAILURES ===================================", title, "",
                          f"    def test_{entry}():", f">       check_{entry}({entry})", "",
                          f"{test_path}:{call_at + 1}: ", "_ " * 40, "",
                          f"candidate = <function {entry} at 0x7f{zlib.crc32(entry.encode()):010x}>", "",
                          *check, f">   {source[fail_at]}", "E       AssertionError", "",
                          f"{test_path}:{fail_at + 1}: AssertionError"])
