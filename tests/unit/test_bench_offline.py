"""``tandem bench offline`` end to end on a tiny random Llama (no download, no timing assertions)."""

from __future__ import annotations

import json

import pytest

from cluster.cli import main
from cluster.models.tiny import save_tiny_model, save_tiny_tokenizer, tiny_llama_config


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(tiny_llama_config(), folder)
    save_tiny_tokenizer(folder)
    return folder


def test_both_systems_every_cell(tiny_folder, tmp_path):
    out = tmp_path / "b.json"
    code = main(["bench", "offline", "--model", str(tiny_folder), "--batch-sizes", "1,2", "--output-len", "4",
                 "--dtypes", "float32", "--kv-cache-memory", "16MiB", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    cells = {(c["system"], c["batch_size"]): c for c in result["cells"]}
    assert set(cells) == {(s, b) for s in ("tandem", "transformers") for b in (1, 2)}
    for (_, batch_size), cell in cells.items():
        assert cell["dtype"] == "float32" and cell["output_len"] == 4
        assert cell["output_tokens"] == batch_size * 4
        assert cell["tok_per_s"] > 0
    assert [(r["dtype"], r["batch_size"]) for r in result["ratios"]] == [("float32", 1), ("float32", 2)]
    assert all(r["tandem_over_transformers"] > 0 for r in result["ratios"])
    assert result["machine"]["read_bandwidth_gb_s"] > 0 and result["machine"]["threads"] >= 1
    (bound,) = result["bandwidth_bound"]
    assert bound["bytes_per_token"] == result["settings"]["num_params_per_token"] * 4
    assert bound["tandem_batch1_fraction"] > 0 and bound["transformers_batch1_fraction"] > 0


def test_one_system_only(tiny_folder, tmp_path):
    out = tmp_path / "b.json"
    main(["bench", "offline", "--model", str(tiny_folder), "--batch-sizes", "3", "--output-len", "2",
          "--dtypes", "float32", "--systems", "transformers", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [(c["system"], c["output_tokens"]) for c in result["cells"]] == [("transformers", 6)]
    assert result["ratios"] == []


@pytest.mark.parametrize("flag,value", [("--batch-sizes", "1,x"), ("--dtypes", "int4"), ("--systems", "sglang")])
def test_bad_lists_are_rejected(flag, value, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "offline", flag, value])
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and value in err


def test_tp_compares_step_latency(tiny_folder, tmp_path):
    import torch

    out = tmp_path / "tp.json"
    threads = torch.get_num_threads()
    try:
        code = main(["bench", "offline", "--model", str(tiny_folder), "--batch-sizes", "2", "--output-len", "4",
                     "--dtypes", "float32", "--systems", "tandem", "--tp", "2", "--threads", "1",
                     "--kv-cache-memory", "16MiB", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    result = json.loads(out.read_text())
    assert {c["system"] for c in result["cells"]} == {"tandem", "tandem-tp2"}
    for cell in result["cells"]:
        assert cell["output_tokens"] == 8 and cell["num_steps"] >= 4 and cell["mean_step_ms"] > 0
    (row,) = result["tensor_parallel"]
    assert row["tp"] == 2 and row["tp_over_tp1_step_latency"] > 0


def test_ratios_set_tandem_against_each_peer_measured_in_the_cell():
    """The ratio arithmetic on fixed numbers (no timing): a peer missing from a cell gets no ratio."""
    from types import SimpleNamespace

    from cluster.bench.offline import Cell, _result

    def cell(system: str, batch_size: int, tok_per_s: float) -> Cell:
        return Cell(system, "float32", batch_size, 4, 4 * batch_size, 1.0, tok_per_s)

    cells = [cell("tandem", 1, 60.0), cell("transformers", 1, 20.0), cell("vllm", 1, 40.0),
             cell("tandem", 8, 300.0), cell("vllm", 8, 200.0), cell("transformers", 32, 100.0)]
    args = SimpleNamespace(dtypes=["float32"], batch_sizes=[1, 8, 32], systems=["tandem", "transformers", "vllm"],
                           model="m", output_len=4, repeats=1, tp=1)
    result = _result(args, SimpleNamespace(path="m"), cells, 40.0, 1_000_000, [[1, 2]])
    assert result["ratios"] == [
        {"dtype": "float32", "batch_size": 1, "tandem_over_transformers": 3.0, "tandem_over_vllm": 1.5},
        {"dtype": "float32", "batch_size": 8, "tandem_over_vllm": 1.5},
    ]  # batch 32 has no Tandem cell, so no ratio
    (bound,) = result["bandwidth_bound"]
    assert bound["bound_tok_per_s"] == 40e9 / 4e6 and bound["vllm_batch1_fraction"] == 40.0 / bound["bound_tok_per_s"]
