"""``tandem bench long-context`` end to end on the tiny random Llama (no timing assertions)."""

from __future__ import annotations

import json

import pytest
import yaml

from cluster.cli import main


def _run(tiny_llama_dir, tmp_path, *extra) -> dict:
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({"model": {"model": str(tiny_llama_dir), "dtype": "float32"},
                                      "device": {"device": "cpu"}, "cache": {"block_size": 16}}))
    out = tmp_path / "long-context.json"
    assert main(["bench", "long-context", "--config", str(config), "--contexts", "40,70", "--batches", "1,2",
                 "--ks", "0,2", "--kv-cache-memory", "16MiB", "--repeats", "1", *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_every_cell_is_timed_for_both_kv_dtypes_beside_its_kv_bytes(tiny_llama_dir, tmp_path, capsys):
    result = _run(tiny_llama_dir, tmp_path)
    assert result["run"]["benchmark"] == "long-context" and result["read_speed_gbps"] > 0
    cells = [(r["kv_cache_dtype"], r["context"], r["batch"]) for r in result["rows"]]
    assert cells == [(kv, c, b) for kv in ("auto", "int8") for c in (40, 70) for b in (1, 2)]
    per_token = {}
    for row in result["rows"]:
        assert set(row["step_ms"]) == {"0", "2"} and all(ms > 0 for ms in row["step_ms"].values())
        assert row["kv_bytes_plain_step"] % (row["batch"] * row["context"]) == 0
        per_token[row["kv_cache_dtype"]] = row["kv_bytes_plain_step"] // (row["batch"] * row["context"])
        assert row["kv_floor_ms"] == pytest.approx(row["kv_bytes_plain_step"] / (result["read_speed_gbps"] * 1e6),
                                                   rel=0.06, abs=0.01)
    assert per_token["int8"] < per_token["auto"]  # int8 values and a scale against float32
    assert "k2/k0" in capsys.readouterr().out


def test_prompts_beside_decodes_come_in_chunks_of_the_cap(tiny_llama_dir, tmp_path, capsys):
    result = _run(tiny_llama_dir, tmp_path, "--skip-steps", "--stall-caps", "0,8", "--stall-decodes", "2",
                  "--stall-context", "20", "--stall-prompt", "40")
    assert result["rows"] == []
    off, capped = result["stalls"]["rows"]
    assert (off["cap"], capped["cap"]) == (0, 8)
    assert off["steps"] == 1 and capped["steps"] == 5  # 40 prompt tokens, 8 a step beside the decodes
    assert all(row["longest_wait_ms"] >= row["median_wait_ms"] > 0 and row["ttft_s"] > 0 for row in (off, capped))
    assert "prompt comes in" in capsys.readouterr().out


def test_bad_lists_are_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "long-context", "--ks", "0,x"])
    assert "comma-separated integers" in capsys.readouterr().err
