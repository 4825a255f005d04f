"""``tandem bench lora`` end to end on a tiny random Llama, Tandem only (no timing assertions):
every adapter loaded at start, and served on demand with room for fewer than there are."""

from __future__ import annotations

import json

import pytest

from cluster.cli import main


@pytest.mark.parametrize("held", [None, 1])
def test_every_cell_with_adapters_loaded_at_start_or_on_demand(tiny_llama_dir, tmp_path, held):
    out = tmp_path / "b.json"
    args = ["bench", "lora", "--model", str(tiny_llama_dir), "--systems", "tandem", "--batch-sizes", "3",
            "--output-len", "4", "--rank", "4", "--num-adapters", "3", "--repeats", "1", "--json", str(out)]
    assert main(args + (["--max-loras", str(held)] if held else [])) == 0
    result = json.loads(out.read_text())
    assert result["max_loras"] == held and result["num_adapters"] == 3
    cells = {(c["workload"], c["batch_size"]): c for c in result["cells"]}
    assert set(cells) == {(w, 3) for w in ("base", "one", "mixed")}
    assert all(c["output_tokens"] == c["batch_size"] * 4 and c["tok_per_s"] > 0 for c in cells.values())
    assert [r["workload"] for r in result["rows"]] == ["base", "one", "mixed"]
    assert all(r["tandem_over_base"] > 0 for r in result["rows"])
