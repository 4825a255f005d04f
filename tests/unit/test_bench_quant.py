"""``tandem bench quant`` end to end on a tiny random Llama: kernels and engine parts in bfloat16
with the int8 and 4-bit configurations (the quality part needs a chat template the tiny tokenizer
lacks; its comparisons are tested in test_quant.py). No timing is asserted."""

from __future__ import annotations

import json

from cluster.cli import main
from cluster.kernels.build import lowbit_gemm
from cluster.models.tiny import save_tiny_model, save_tiny_tokenizer, tiny_llama_config


def test_kernels_and_engine_measure_int8_and_int4_in_bfloat16(tmp_path):
    save_tiny_model(tiny_llama_config(), tmp_path / "tiny")
    save_tiny_tokenizer(tmp_path / "tiny")
    out = tmp_path / "quant.json"
    assert main(["bench", "quant", "--model", str(tmp_path / "tiny"), "--dtype", "bfloat16", "--configs",
                 "full,int8,int4", "--rows", "1,4,32", "--batch-sizes", "1,2", "--output-len", "4", "--repeats", "2",
                 "--skip", "quality", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["dtype"] == "bfloat16" and "quality" not in result
    steps = {(c["rows"], c["kernel"]): c["ms"] for c in result["decode_step_linear_ms"]}
    for kernel in ("int8-lowbit", "int4-lowbit"):
        assert steps[(32, kernel)] is None  # the kernels take 1 to 16 rows
        for rows in (1, 4):
            assert (steps[(rows, kernel)] is None) == (lowbit_gemm() is None)
    engine = {(r["config"], r["batch_size"]): r for r in result["engine"]}
    assert set(engine) == {(c, b) for c in ("full", "int8", "int4") for b in (1, 2)}
    assert all(engine[("full", b)]["vs_full"] == 1.0 for b in (1, 2))
    assert all(r["tok_per_s"] > 0 and r["vs_full"] > 0 for r in engine.values())
