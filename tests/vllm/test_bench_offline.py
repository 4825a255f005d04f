"""``tandem bench offline`` with vLLM's ``LLM.generate`` as a system, side by side with Tandem.
No assertion on speed: every cell is measured with the right token count, and each batch
size gets a Tandem-over-vLLM ratio (its arithmetic is tested on fixed numbers in
tests/unit/test_bench_offline.py)."""

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
        assert cell["output_tokens"] == batch_size * 6  # measure_cell also refuses a wrong count
    assert [(r["batch_size"], sorted(k for k in r if k.startswith("tandem_over"))) for r in result["ratios"]] == [
        (1, ["tandem_over_vllm"]), (2, ["tandem_over_vllm"])]
