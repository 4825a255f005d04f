"""k re-fitted online for vLLM groups, the replica's half (no vLLM here): the schedule file, the
draft outcomes rebuilt from vLLM's per-position counters, and the controller fed by vLLM-shaped
steps rewriting the file when its table changes. The scheduler's half (reading the file inside
vLLM) is tests/vllm/test_k_schedule.py."""

from __future__ import annotations

import random
from types import SimpleNamespace

from cluster.backends.vllm_args import FOLLOWING_SCHEDULER, vllm_settings
from cluster.backends.vllm_k_schedule import (READ_EVERY_S, REWRITE_EVERY_S, OnlineSchedule, ScheduleFile,
                                              drafts_from_counts)
from cluster.config import config_from_dict
from cluster.spec_decode.controller import AdaptiveController
from cluster.spec_decode.prior import prior_model
from cluster.spec_decode.profile_data import batch_size_ranges


def test_the_file_is_read_once_per_new_version_and_not_more_often_than_asked(tmp_path):
    writer, reader = ScheduleFile(tmp_path / "s.json"), ScheduleFile(tmp_path / "s.json")
    assert reader.read_if_changed(now=0.0) is None  # nothing written yet
    writer.write([[1, 3, 4], [4, 4, 2]])
    assert reader.read_if_changed(now=10.0) == [[1, 3, 4], [4, 4, 2]] and reader.version == 1
    assert reader.read_if_changed(now=20.0) is None  # the same version
    writer.write([[1, 1, 0]])
    assert reader.read_if_changed(now=20.0 + READ_EVERY_S / 2) is None  # not looked at yet
    assert reader.read_if_changed(now=21.0) == [[1, 1, 0]]
    assert not (tmp_path / "s.json.tmp").exists()  # replaced whole


def _counts(tuples, k):
    """vLLM's SpecDecodingStats counters of requests' (asked, proposed, accepted)."""
    return ([sum(1 for _, p, _ in tuples if p > j) for j in range(k)],
            [sum(1 for _, _, a in tuples if a > j) for j in range(k)])


def test_rebuilt_drafts_give_the_same_counts_at_every_position():
    rng = random.Random(3)
    for _ in range(200):
        k = rng.randint(1, 8)
        tuples = []
        for _ in range(rng.randint(0, 12)):
            proposed = rng.randint(0, k)
            tuples.append((k, proposed, rng.randint(0, proposed)))
        drafted, accepted = _counts(tuples, k)
        rebuilt = drafts_from_counts(k, len(tuples), drafted, accepted)
        assert len(rebuilt) == len(tuples) and all(a <= p <= k for _, p, a in rebuilt)
        assert _counts(rebuilt, k) == (drafted, accepted)


def _spec(k, tuples):
    drafted, accepted = _counts(tuples, k)
    return SimpleNamespace(num_drafts=len(tuples), num_draft_tokens=sum(p for _, p, _ in tuples),
                           num_draft_tokens_per_pos=drafted, num_accepted_tokens_per_pos=accepted)


def test_a_controller_fed_vllms_steps_rewrites_the_schedule_when_its_table_changes(tmp_path):
    """Drafts never accepted: the table the file holds moves from k = 4 to less speculation."""
    controller = AdaptiveController(prior_model("ngram", "cpu"), [0.9] * 4, 4)
    start = {1: 4, 2: 4, 4: 4, 8: 4}
    online = OnlineSchedule(controller, [1, 2, 4, 8], start, ScheduleFile(tmp_path / "s.json"))
    reader = ScheduleFile(tmp_path / "s.json")
    assert reader.read_if_changed(now=0.0) == batch_size_ranges(start)
    now = 0.0
    for step in range(3000):
        batch = (1, 2, 4, 8)[step % 4]
        k = online.k_for_batch(batch)
        spec = _spec(k, [(k, k, 0)] * batch) if k else None
        seconds = 0.01 * (1 + 0.1 * batch) * (1 + 0.3 * k)
        online.observe_step(batch, k, seconds, 0, spec, now=now)
        now += 0.05
    assert online.rewrites >= 1
    assert all(k < 4 for k in online.table.values()), online.table
    assert reader.read_if_changed(now=1e9) == batch_size_ranges(online.table)  # the file holds the table in force
    assert online.k_for_batch(3) == online.table[2]  # between entries: the entry below, as vLLM reads the ranges


def test_steps_with_prompt_tokens_teach_nothing_and_rewrites_wait_their_interval(tmp_path):
    seen = []
    controller = SimpleNamespace(observe=seen.append, k_table=lambda sizes: {b: 1 for b in sizes})
    online = OnlineSchedule(controller, [1, 2], {1: 3, 2: 3}, ScheduleFile(tmp_path / "s.json"))
    online.observe_step(1, 3, 0.02, 128, None, now=0.0)  # a prompt chunk rode along
    assert seen == [] and online.rewrites == 0
    online.observe_step(1, 3, 0.02, 0, None, now=0.0)
    assert len(seen) == 1 and online.table == {1: 1, 2: 1} and online.rewrites == 1
    controller.k_table = lambda sizes: {b: 2 for b in sizes}
    online.observe_step(1, 1, 0.02, 0, None, now=REWRITE_EVERY_S / 2)
    assert online.table == {1: 1, 2: 1}  # compared again only after the interval
    online.observe_step(1, 1, 0.02, 0, None, now=REWRITE_EVERY_S * 1.5)
    assert online.table == {1: 2, 2: 2} and online.rewrites == 2


def test_only_the_adaptive_controller_names_the_following_scheduler(tmp_path):
    def settings(controller):
        config = config_from_dict({"model": {"max_model_len": 512}, "cache": {"kv_cache_memory": "64MiB"},
                                   "speculative": {"method": "ngram", "num_speculative_tokens": 4,
                                                   "controller": controller, "profile": str(tmp_path / "p.json")}})
        return vllm_settings(config, 1, "/m", None, {1: 4, 8: 2}, has_batch_size_schedule=True)

    adaptive, table = settings("adaptive"), settings("table")
    assert adaptive.spec.policy == "adaptive-table" and adaptive.engine_args["scheduler_cls"] == FOLLOWING_SCHEDULER
    assert adaptive.engine_args["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 7, 4], [8, 8, 2]]
    assert table.spec.policy == "batch-size-table" and "scheduler_cls" not in table.engine_args
