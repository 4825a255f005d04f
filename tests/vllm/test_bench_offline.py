"""``tandem bench offline`` with vLLM's ``LLM.generate`` as a system, side by side with Tandem
(no timing assertions: the cells are complete and the ratios are taken from them)."""

from __future__ import annotations

import json
import sys

from cluster.cli import main


def test_tandem_and_vllm_cells_and_their_ratio(tmp_path):
    out = tmp_path / "offline.json"
    code = main(["bench", "offline", "--systems", "tandem,vllm", "--batch-sizes", "1,2", "--output-len", "6",
                 "--dtypes", "float32", "--threads", "1", "--kv-cache-memory", "64MiB",
                 "--vllm-python", sys.executable, "--vllm-eager", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    cells = {(c["system"], c["batch_size"]): c for c in result["cells"]}
    assert set(cells) == {(s, b) for s in ("tandem", "vllm") for b in (1, 2)}
    for (_, batch_size), cell in cells.items():
        assert cell["output_tokens"] == batch_size * 6  # _measure also refuses a wrong count
    for row in result["ratios"]:
        tandem, vllm = cells[("tandem", row["batch_size"])], cells[("vllm", row["batch_size"])]
        assert row["tandem_over_vllm"] == tandem["tok_per_s"] / vllm["tok_per_s"]
        assert "tandem_over_transformers" not in row
