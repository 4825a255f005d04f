"""Figure tables in docs/ made from kept benchmark records (``tandem bench tables``).

A chapter marks a table it takes from records with two comments:

    <!-- table: served_cells records=records/served-agentic-zen4.json figures=output_throughput,median_tpot_ms -->
    (the table, written by the command)
    <!-- /table -->

The records are the JSON the benchmarks write (``--json``), with their ``run`` stamp (command,
commit, machine), kept beside the docs in ``docs/records/``. ``tandem bench tables`` writes every
marked table of the chapters and of the README beside their folder again from its records, so a
table never disagrees with its run and a run on another machine kind adds rows, not prose;
``--check`` writes nothing and fails where a table differs.

Renderers (the word after ``table:``), and their options (``key=value``, lists comma-separated):

- ``served_cells``: ``tandem bench served`` records, a row per cell, each figure's values for
  ``systems`` (default every system of the first record, in its order) joined by " / ";
  ``figures`` from :data:`SERVED_FIGURES`; ``labels``: per record, a note added to its rows' cell
  names (``_`` for a space, ``-`` for none).
- ``rows``: any benchmark's record, a row per entry of the list at ``rows`` (a dotted path into the
  record, e.g. ``tandem.cells``; of a mapping of mappings, each value with its name as ``key``);
  ``columns`` are dotted paths into an entry, each with an optional format after ``:``
  (``tok_per_s:.1f``, ``acceptance_rate:.0%``); ``titles`` names them (``_`` for a space; default
  the paths); ``where`` keeps the entries whose ``key:value`` conditions all hold
  (``;`` between conditions, ``|`` between a key's accepted values); ``labels``: per record, the
  first column's value for its rows, under the title ``label_title`` (default ``run``); ``pivot``
  (``KEY:PATH[:FORMAT]``) makes a column of each value of the entries' KEY, holding their PATH, so
  the entries that agree on ``columns`` share a row.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

# figure key -> (column title, value in the column's unit)
SERVED_FIGURES: dict[str, tuple[str, Callable[[float], str]]] = {
    "output_throughput": ("output tok/s", lambda v: f"{v:.1f}"),
    "mean_ttft_ms": ("TTFT mean (s)", lambda v: f"{v / 1000:.2f}"),
    "p99_ttft_ms": ("TTFT p99 (s)", lambda v: f"{v / 1000:.2f}"),
    "median_tpot_ms": ("TPOT median (ms)", lambda v: f"{v:.1f}"),
    "p99_tpot_ms": ("TPOT p99 (ms)", lambda v: f"{v:.1f}"),
    "median_itl_ms": ("ITL median (ms)", lambda v: f"{v:.1f}"),
    "num_preemptions": ("preemptions", lambda v: f"{v:.0f}"),
}

_BLOCK = re.compile(r"(<!-- table: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def _options(spec: str) -> tuple[str, dict[str, str]]:
    words = spec.split()
    if not words:
        raise ValueError("a table comment names no renderer: <!-- table: RENDERER key=value ... -->")
    options = {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or not value:
            raise ValueError(f"table option {word!r} is not key=value")
        options[key] = value
    return words[0], options


def _provenance(records: list[tuple[str, dict]]) -> str:
    """Where the records came from: their names grouped by machine, commit and day."""
    groups: dict[str, list[str]] = {}
    for name, record in records:
        run = record.get("run", {})
        machine = run.get("machine", {})
        commit = (run.get("code", {}).get("commit") or "?")[:7]
        where = (f"{machine.get('cpu', '?')} ({machine.get('cpu_kind', '?')}), {machine.get('cores_available', '?')} "
                 f"cores, commit {commit}, {run.get('started_utc', '?')[:10]}")
        groups.setdefault(where, []).append(name)
    return "; ".join(f"{', '.join(names)}: {where}" for where, names in groups.items())


def served_cells(records: list[tuple[str, dict]], options: dict[str, str]) -> str:
    """A markdown table of ``tandem bench served`` records (see the module's docstring)."""
    figures = options.get("figures", "output_throughput,mean_ttft_ms,median_tpot_ms,p99_tpot_ms").split(",")
    unknown = [f for f in figures if f not in SERVED_FIGURES]
    if unknown:
        raise ValueError(f"unknown served figures {unknown}; choose from {', '.join(SERVED_FIGURES)}")
    systems = options.get("systems", ",".join(records[0][1].get("systems", {}))).split(",")
    labels = options.get("labels", "").split(",") if "labels" in options else ["-"] * len(records)
    if len(labels) != len(records):
        raise ValueError(f"labels has {len(labels)} entries for {len(records)} records")
    lines = [f"| cell | {' | '.join(SERVED_FIGURES[f][0] for f in figures)} |",
             "|" + "---|" * (len(figures) + 1)]
    for (name, record), label in zip(records, labels):
        found = record.get("systems", {})
        missing = [s for s in systems if s not in found]
        if missing:
            raise ValueError(f"{name} has no system {missing} (it has {', '.join(found)})")
        note = "" if label == "-" else f" ({label.replace('_', ' ')})"
        for cell in found[systems[0]]:
            values = []
            for figure in figures:
                title, fmt = SERVED_FIGURES[figure]
                got = [found[s].get(cell, {}).get(figure) for s in systems]
                values.append(" / ".join("-" if v is None else fmt(v) for v in got))
            lines.append(f"| {cell}{note} | {' | '.join(values)} |")
    lines.append("")
    lines.append(f"({' / '.join(systems)}; {_provenance(records)})")
    return "\n".join(lines) + "\n"


def _at(data, path: str):
    """``data``'s value at the dotted ``path`` (None where any step is missing)."""
    for step in path.split("."):
        if isinstance(data, dict):
            data = data.get(step)
        elif isinstance(data, list) and step.isdigit() and int(step) < len(data):
            data = data[int(step)]
        else:
            return None
    return data


def _conditions(text: str) -> list[tuple[str, set[str]]]:
    out = []
    for condition in filter(None, text.split(";")):
        key, sep, values = condition.partition(":")
        if not sep:
            raise ValueError(f"where condition {condition!r} is not key:value")
        out.append((key, set(values.split("|"))))
    return out


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt) if fmt else str(value)


def rows(records: list[tuple[str, dict]], options: dict[str, str]) -> str:
    """A markdown table of the entries of any record's list (see the module's docstring)."""
    if "rows" not in options or "columns" not in options:
        raise ValueError("a rows table needs rows=PATH and columns=PATH[:FORMAT],...")
    columns = [column.partition(":")[::2] for column in options["columns"].split(",")]
    titles = (options["titles"].replace("_", " ").split(",") if "titles" in options
              else [path for path, _ in columns])
    if len(titles) != len(columns):
        raise ValueError(f"titles has {len(titles)} entries for {len(columns)} columns")
    labels = options["labels"].replace("_", " ").split(",") if "labels" in options else None
    if labels is not None and len(labels) != len(records):
        raise ValueError(f"labels has {len(labels)} entries for {len(records)} records")
    pivot_key, _, pivot_value = options.get("pivot", "").partition(":")
    pivot_path, _, pivot_fmt = pivot_value.partition(":")
    if pivot_key and not pivot_path:
        raise ValueError("pivot is KEY:VALUE_PATH[:FORMAT]")
    where = _conditions(options.get("where", ""))
    table: dict[tuple, dict[str, str]] = {}  # the row's leading cells -> pivot column -> cell
    pivots: list[str] = []
    for index, (name, record) in enumerate(records):
        entries = _at(record, options["rows"])
        if isinstance(entries, dict) and all(isinstance(v, dict) for v in entries.values()):
            entries = [{"key": key, **value} for key, value in entries.items()]
        if not isinstance(entries, list):
            raise ValueError(f"{name} has no list at {options['rows']}")
        for number, entry in enumerate(entries):
            if not all(str(_at(entry, key)) in accepted for key, accepted in where):
                continue
            lead = tuple(([labels[index]] if labels else []) + [_cell(_at(entry, path), fmt) for path, fmt in columns])
            if not pivot_key:
                table[(index, number, *lead)] = {}
                continue
            column = str(_at(entry, pivot_key))
            pivots += [column] if column not in pivots else []
            table.setdefault((index, *lead), {})[column] = _cell(_at(entry, pivot_path), pivot_fmt)
    if not table:
        raise ValueError(f"no entries of {options['rows']} pass where={options.get('where')}")
    head = ([options.get("label_title", "run").replace("_", " ")] if labels else []) + titles + pivots
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, by_pivot in table.items():
        lead = key[1:] if pivot_key else key[2:]
        lines.append("| " + " | ".join([*lead, *(by_pivot.get(p, "-") for p in pivots)]) + " |")
    lines.append("")
    lines.append(f"({_provenance(records)})")
    return "\n".join(lines) + "\n"


RENDERERS: dict[str, Callable[[list[tuple[str, dict]], dict[str, str]], str]] = {"served_cells": served_cells,
                                                                                  "rows": rows}


def render_block(spec: str, base: Path) -> str:
    """The table a block's comment asks for, its records read relative to ``base``."""
    renderer, options = _options(spec)
    if renderer not in RENDERERS:
        raise ValueError(f"unknown table renderer {renderer!r}; choose from {', '.join(RENDERERS)}")
    if "records" not in options:
        raise ValueError(f"table {renderer} names no records=...")
    records = []
    for name in options.pop("records").split(","):
        try:
            records.append((name, json.loads((base / name).read_text())))
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read the record {base / name}: {err}") from err
    return RENDERERS[renderer](records, options)


def refresh(path: Path) -> tuple[str, int]:
    """``path``'s text with every marked table made again, and how many blocks changed."""
    text = path.read_text()
    changed = 0

    def again(match: re.Match) -> str:
        nonlocal changed
        try:
            body = render_block(match.group("spec"), path.parent)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err
        changed += body != match.group("body")
        return match.group(1) + body + match.group(4)

    return _BLOCK.sub(again, text), changed


def refresh_docs(folder: Path, check: bool = False) -> list[Path]:
    """Make every marked table in ``folder``'s chapters and the README beside the folder again
    (``check``: write nothing); the files whose tables differed from their records. Every table is
    made before any file is written, so a bad block or a missing record leaves every file as it was."""
    readme = folder.parent / "README.md"
    made = [(path, *refresh(path)) for path in sorted(folder.glob("*.md")) + ([readme] if readme.is_file() else [])]
    stale = [path for path, _, changed in made if changed]
    if not check:
        for path, text, changed in made:
            if changed:
                path.write_text(text)
    return stale
