"""``tandem bench tables``: the docs' marked tables made from kept benchmark records, and the
repository's docs in step with their records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.bench.doc_tables import refresh, refresh_docs, render_block

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _record(tmp_path: Path, name: str, tandem_tpot: float, commit: str = "abcdef0123") -> str:
    cells = {"rate @ 2/s": {"output_throughput": 81.25, "median_tpot_ms": tandem_tpot, "mean_ttft_ms": 8150.0}}
    record = {"systems": {"tandem": cells, "vllm": {"rate @ 2/s": {"output_throughput": 74.7,
                                                                     "median_tpot_ms": 83.9}}},
              "run": {"started_utc": "2026-12-07T21:41:29+00:00", "code": {"commit": commit},
                      "machine": {"cpu": "AMD EPYC", "cpu_kind": "AVX-512 with BF16", "cores_available": 2}}}
    (tmp_path / name).write_text(json.dumps(record))
    return name


def test_a_served_table_has_a_row_per_cell_and_says_where_it_came_from(tmp_path):
    name = _record(tmp_path, "a.json", 77.2)
    table = render_block(f"served_cells records={name} figures=output_throughput,mean_ttft_ms,median_tpot_ms",
                         tmp_path)
    lines = table.splitlines()
    assert lines[0] == "| cell | output tok/s | TTFT mean (s) | TPOT median (ms) |"
    assert lines[2] == "| rate @ 2/s | 81.2 / 74.7 | 8.15 / - | 77.2 / 83.9 |"  # vLLM's record lacks TTFT
    assert "a.json: AMD EPYC (AVX-512 with BF16), 2 cores, commit abcdef0, 2026-12-07" in lines[-1]
    labelled = render_block(f"served_cells records={name},{name} labels=-,fresh_servers systems=tandem", tmp_path)
    assert labelled.splitlines()[-1].endswith("(tandem; a.json, a.json: AMD EPYC (AVX-512 with BF16), 2 cores, "
                                              "commit abcdef0, 2026-12-07)")  # one machine, commit, day: said once
    _record(tmp_path, "b.json", 70.0, commit="9876543210")
    assert "a.json: AMD EPYC (AVX-512 with BF16), 2 cores, commit abcdef0, 2026-12-07; b.json: AMD EPYC " in (
        render_block("served_cells records=a.json,b.json", tmp_path).splitlines()[-1])
    assert "| rate @ 2/s (fresh servers) |" in labelled and "/ 74.7" not in labelled


def test_a_rows_table_takes_chosen_columns_of_any_records_list(tmp_path):
    run = {"started_utc": "2026-12-08T01:00:00+00:00", "code": {"commit": "1234567abc"},
           "machine": {"cpu": "Xeon", "cpu_kind": "AVX2", "cores_available": 2}}
    cells = [{"batch_size": 1, "k": 0, "tok_per_s": 50.04, "acceptance_rate": None, "extra": {"steps": 3}},
             {"batch_size": 1, "k": 4, "tok_per_s": 81.55, "acceptance_rate": 0.4567, "extra": {"steps": 2}},
             {"batch_size": 8, "k": 4, "tok_per_s": 301.0, "acceptance_rate": 0.5, "extra": {}}]
    (tmp_path / "spec.json").write_text(json.dumps({"tandem": {"cells": cells}, "run": run}))
    table = render_block("rows records=spec.json rows=tandem.cells columns=batch_size,k,tok_per_s:.1f,"
                         "acceptance_rate:.0%,extra.steps titles=batch,k,tok/s,accepted,target_steps "
                         "where=batch_size:1", tmp_path)
    lines = table.splitlines()
    assert lines[0] == "| batch | k | tok/s | accepted | target steps |"
    assert lines[2:4] == ["| 1 | 0 | 50.0 | - | 3 |", "| 1 | 4 | 81.5 | 46% | 2 |"] and len(lines) == 6
    assert "spec.json: Xeon (AVX2), 2 cores, commit 1234567, 2026-12-08" in lines[-1]
    two = render_block("rows records=spec.json,spec.json rows=tandem.cells columns=k labels=Zen_4,Xeon "
                       "label_title=machine where=batch_size:8;k:2|4", tmp_path).splitlines()
    assert two[0] == "| machine | k |" and two[2:4] == ["| Zen 4 | 4 |", "| Xeon | 4 |"]
    assert render_block("rows records=spec.json rows=tandem.cells columns=k labels=a where=k:4",
                        tmp_path).splitlines()[0] == "| run | k |"
    pivoted = render_block("rows records=spec.json rows=tandem.cells columns=batch_size titles=batch "
                           "pivot=k:tok_per_s:.0f", tmp_path).splitlines()
    assert pivoted[:4] == ["| batch | 0 | 4 |", "|---|---|---|", "| 1 | 50 | 82 |", "| 8 | - | 301 |"]
    (tmp_path / "quant.json").write_text(json.dumps({"quality": {"int8": {"top1": 0.977}, "int4": {"top1": 0.5}},
                                                     "run": run}))
    named = render_block("rows records=quant.json rows=quality columns=key,top1:.1% titles=weights,top-1",
                         tmp_path).splitlines()
    assert named[2:4] == ["| int8 | 97.7% |", "| int4 | 50.0% |"]


def test_a_chapter_is_made_again_and_check_reports_a_table_that_drifted(tmp_path):
    _record(tmp_path, "r.json", 77.2)
    chapter = tmp_path / "c.md"
    chapter.write_text("before\n<!-- table: served_cells records=r.json -->\nstale\n<!-- /table -->\nafter\n")
    assert refresh_docs(tmp_path, check=True) == [chapter]
    assert "stale" in chapter.read_text()  # check writes nothing
    assert refresh_docs(tmp_path) == [chapter]
    text = chapter.read_text()
    assert text.startswith("before\n<!-- table: served_cells records=r.json -->\n| cell |")
    assert text.endswith("<!-- /table -->\nafter\n") and "77.2 / 83.9" in text
    assert refresh_docs(tmp_path, check=True) == []
    _record(tmp_path, "r.json", 70.0)  # a new run of the record
    assert refresh_docs(tmp_path, check=True) == [chapter]


def test_a_missing_record_leaves_every_file_as_it_was(tmp_path):
    _record(tmp_path, "r.json", 77.2)
    first, second = tmp_path / "a.md", tmp_path / "b.md"
    first.write_text("<!-- table: served_cells records=r.json -->\nstale\n<!-- /table -->\n")
    second.write_text("<!-- table: served_cells records=gone.json -->\n<!-- /table -->\n")
    with pytest.raises(ValueError, match="cannot read the record"):
        refresh_docs(tmp_path)
    assert "stale" in first.read_text()  # made, but not written: b.md's table could not be


def test_the_readme_beside_the_chapters_is_made_too(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    _record(docs, "r.json", 77.2)
    readme = tmp_path / "README.md"
    readme.write_text("# X\n<!-- table: served_cells records=docs/r.json -->\n<!-- /table -->\n")
    assert refresh_docs(docs) == [readme]
    assert "77.2 / 83.9" in readme.read_text()


@pytest.mark.parametrize("spec, message", [
    ("nonsense records=r.json", "unknown table renderer"),
    ("served_cells", "names no records"),
    ("served_cells records=missing.json", "cannot read the record"),
    ("served_cells records=r.json figures=speed", "unknown served figures"),
    ("served_cells records=r.json systems=tandem,sglang", "has no system"),
    ("served_cells records=r.json labels=a,b", "labels has 2 entries"),
    ("served_cells records", "is not key=value"),
    ("rows records=r.json columns=a", "needs rows=PATH"),
    ("rows records=r.json rows=run.machine columns=a", "has no list at run.machine"),
    ("rows records=r.json rows=run.x columns=a", "has no list at run.x"),
    ("rows records=r.json rows=cells columns=a,b titles=x", "titles has 1 entries"),
    ("rows records=r.json rows=cells columns=a pivot=k", "pivot is KEY:VALUE_PATH"),
])
def test_a_bad_table_comment_says_what_is_wrong(tmp_path, spec, message):
    _record(tmp_path, "r.json", 77.2)
    chapter = tmp_path / "c.md"
    chapter.write_text(f"<!-- table: {spec} -->\n<!-- /table -->\n")
    with pytest.raises(ValueError, match=message):
        refresh(chapter)


def test_the_repositorys_tables_agree_with_their_records():
    assert list(DOCS.glob("records/*.json")), "docs/records holds the records the chapters' tables come from"
    stale = refresh_docs(DOCS, check=True)
    assert stale == [], f"run `tandem bench tables`: {[p.name for p in stale]} differ from their records"
