"""The report of a validation run: one :class:`CheckResult` per check, written as JSON and as text.

Standard library only, so that a run whose packages are missing still reports what it could not do.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATUSES = ("passed", "failed", "skipped", "error")


@dataclass
class CheckResult:
    """One check: ``passed`` or ``failed`` (what was compared and where it parted, in ``data``),
    ``skipped`` (not run, ``detail`` says why) or ``error`` (it could not run to the end)."""

    name: str
    status: str
    detail: str = ""
    data: dict = field(default_factory=dict)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


def summary(results: list[CheckResult]) -> dict[str, int]:
    return {status: sum(r.status == status for r in results) for status in STATUSES}


def write(out: Path, document: dict, text: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "validate.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
    (out / "validate.txt").write_text(text + "\n")


def document(settings: dict, environment: dict, stage: dict, results: list[CheckResult],
             throughput: dict | None) -> dict:
    return {"settings": settings, "environment": environment, "stage": stage,
            "checks": [asdict(r) for r in results], "summary": summary(results), "throughput": throughput}


def text(doc: dict, throughput_table: str | None) -> str:
    env = doc["environment"]
    lines = [f"Tandem GPU validation on {doc['settings']['device']} "
             f"({env.get('gpu', 'no GPU')}, python {env.get('python')}, torch cuda {env.get('torch_cuda')})"]
    if env.get("missing"):
        lines.append(f"missing packages: {', '.join(env['missing'])}")
    differing = {n: p for n, p in env.get("packages", {}).items()
                 if p.get("pin") and p["version"].split("+")[0] != p["pin"]}  # 2.13.0+cpu is 2.13.0
    if differing:
        lines.append("not at the project's pins: " + ", ".join(f"{n} {p['version']} (pin {p['pin']})"
                                                               for n, p in differing.items()))
    for problem in doc["stage"].get("problems", []):
        lines.append(f"carry: {problem}")
    lines.append("")
    for check in doc["checks"]:
        lines.append(f"{check['status']:>7}  {check['name']:<28} {check['seconds']:7.1f}s  {check['detail']}")
    counts = doc["summary"]
    lines.append(", ".join(f"{counts[s]} {s}" for s in STATUSES))
    if throughput_table:
        lines += ["", throughput_table]
    return "\n".join(lines)
