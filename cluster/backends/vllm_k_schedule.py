"""k re-fitted online for a vLLM group: Tandem's adaptive controller learns from vLLM's own
steps and hands vLLM's scheduler a new batch-size -> k schedule while it runs.

vLLM 0.32 picks k at every step from a dense batch-size lookup it builds once from
``num_speculative_tokens_per_batch_size``; nothing in its API changes that lookup later. What it
does allow is a scheduler class of one's own (``scheduler_cls``): ``vllm_scheduler.py`` is vLLM's
scheduler that, before each step, reads the schedule again from a small JSON file when its
version changed. This module is the replica's half, without vLLM: the file (:class:`ScheduleFile`),
the per-request draft outcomes rebuilt from vLLM's per-position counters
(:func:`drafts_from_counts`) and :class:`OnlineSchedule`, which feeds the controller every
decode step vLLM reports and rewrites the file when the table in force changes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from cluster.config import TandemConfig
from cluster.spec_decode.controller import AdaptiveController, BatchState, StepObservation, TableController
from cluster.spec_decode.factory import build_controller
from cluster.spec_decode.latency_model import power_of_two_sizes
from cluster.spec_decode.profile_data import batch_size_ranges

ENV = "TANDEM_VLLM_K_SCHEDULE"  # the file's path, as vLLM's engine-core process inherits it
REWRITE_EVERY_S = 1.0  # the replica compares the table in force with the file's at most this often
READ_EVERY_S = 0.25  # vLLM's scheduler looks at the file at most this often


class ScheduleFile:
    """``{"version": n, "ranges": [[start, end, k], ...]}``, replaced whole (``os.replace``), so a
    reader sees the old schedule or the new one, never half of one."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.version = 0  # the last written (writer) or read (reader)
        self._checked = float("-inf")

    def write(self, ranges: list[list[int]]) -> None:
        self.version += 1
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"version": self.version, "ranges": ranges}))
        os.replace(tmp, self.path)

    def read_if_changed(self, now: float | None = None) -> list[list[int]] | None:
        """The ranges when a newer version is there than the last read (checked at most every
        ``READ_EVERY_S``), else None."""
        now = time.monotonic() if now is None else now
        if now - self._checked < READ_EVERY_S:
            return None
        self._checked = now
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if int(data.get("version", 0)) <= self.version:
            return None
        self.version = int(data["version"])
        return [[int(v) for v in entry] for entry in data["ranges"]]


def drafts_from_counts(k: int, num_drafts: int, drafted_per_position: list[int],
                       accepted_per_position: list[int]) -> list[tuple[int, int, int]]:
    """Per request asked for drafts, (k, tokens proposed, tokens accepted), from one step's counts
    (vLLM reports how many requests had a draft, and an accepted one, at each position). The
    requests' pairing is lost; these tuples give the controller the same counts at every position."""
    out = []
    for i in range(num_drafts):
        proposed = sum(1 for n in drafted_per_position if n > i)
        accepted = sum(1 for n in accepted_per_position if n > i)
        out.append((k, proposed, min(accepted, proposed)))
    return out


class OnlineSchedule:
    """The table vLLM runs, kept by an adaptive controller from vLLM's own steps."""

    def __init__(self, controller: AdaptiveController, batch_sizes: list[int], table: dict[int, int],
                 file: ScheduleFile) -> None:
        self.controller = controller
        self.batch_sizes = batch_sizes
        self.file = file
        self.table = dict(table)  # what the file holds now
        self._lookup = TableController(self.table)
        self.rewrites = 0
        self._compared = float("-inf")
        file.write(batch_size_ranges(self.table))

    def k_for_batch(self, batch_size: int) -> int:
        return self._lookup.choose_k(BatchState(batch_size, 0))

    def observe_step(self, batch_size: int, k: int, seconds: float, prefill_tokens: int, spec,
                     now: float | None = None) -> None:
        """One vLLM step (``spec``: its SpecDecodingStats, or None). Steps carrying prompt tokens
        are left out, as the native engine leaves them out of its controller."""
        if prefill_tokens or batch_size < 1 or seconds <= 0:
            return
        drafts = [] if spec is None or k == 0 else drafts_from_counts(
            k, int(spec.num_drafts), list(spec.num_draft_tokens_per_pos), list(spec.num_accepted_tokens_per_pos))
        drafted = None if spec is None else int(spec.num_draft_tokens)
        self.controller.observe(StepObservation(batch_size, k, seconds, drafts, drafted))
        now = time.monotonic() if now is None else now
        if now - self._compared >= REWRITE_EVERY_S:
            self._compared = now
            table = self.controller.k_table(self.batch_sizes)
            if table != self.table:
                self.table, self._lookup = table, TableController(table)
                self.file.write(batch_size_ranges(table))
                self.rewrites += 1

    def close(self) -> None:
        shutil.rmtree(self.file.path.parent, ignore_errors=True)


def online_schedule(config: TandemConfig, policy: str, table: dict[int, int],
                    max_num_seqs: int) -> OnlineSchedule | None:
    """For a group whose plan is ``adaptive-table``: the adaptive controller (from the group's
    profile) and the profiled ``table`` it starts from, in a file of the replica's own."""
    if policy != "adaptive-table":
        return None
    folder = Path(tempfile.mkdtemp(prefix="tandem-vllm-k-"))
    return OnlineSchedule(build_controller(config), power_of_two_sizes(max_num_seqs), table,
                          ScheduleFile(folder / "schedule.json"))
