"""``tandem bench offline --llamacpp``: llama-bench's decode figure on the anchor's GGUF file, set
beside Tandem on that file's blocks at batch 1. A stand-in llama-bench (a script printing the JSON
llama-bench prints) checks the wiring; no timing is asserted."""

from __future__ import annotations

import json
import stat

import pytest

from cluster.bench.llama_bench import parse_llama_bench
from cluster.cli import main
from cluster.models.loader import resolve_model
from tests.unit.test_gguf_linear import gguf_model, needs_kernel  # noqa: F401 (a fixture)


def _record(n_prompt: int, n_gen: int, tok_per_s: float) -> dict:
    return {"build_commit": "0c1e570", "model_type": "llama 256M Q4_1", "model_size": 96576768, "n_threads": 2,
            "n_prompt": n_prompt, "n_gen": n_gen, "avg_ts": tok_per_s, "stddev_ts": 1.5}


def test_the_decode_test_is_read_from_llama_benchs_json():
    result = parse_llama_bench(json.dumps([_record(128, 0, 220.0), _record(0, 128, 92.0)]))
    assert (result.tok_per_s, result.stddev_tok_per_s, result.model_bytes, result.threads) == (92.0, 1.5, 96576768, 2)
    assert result.model_type == "llama 256M Q4_1" and result.build == "0c1e570"
    with pytest.raises(ValueError, match="found 2"):
        parse_llama_bench(json.dumps([_record(0, 16, 90.0), _record(0, 128, 92.0)]))


def _script(path, body: str):
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@needs_kernel
def test_offline_sets_llama_bench_beside_tandem_on_the_files_blocks(gguf_model, tmp_path):  # noqa: F811
    folder = resolve_model(str(gguf_model), cache_dir=gguf_model.parent / "cache").path
    calls = tmp_path / "calls.txt"
    fake_bench = _script(tmp_path / "llama-bench",
                         f'echo "$@" >> {calls}\ncat <<"EOF"\n{json.dumps([_record(0, 4, 50.0)])}\nEOF\n')
    anchor = _script(tmp_path / "llamacpp_cpu.sh", f'[ "$1" = gguf ] && echo {gguf_model}\n')
    out = tmp_path / "b.json"
    code = main(["bench", "offline", "--model", str(folder), "--batch-sizes", "1,2", "--output-len", "4",
                 "--dtypes", "float32", "--systems", "tandem", "--kv-cache-memory", "16MiB", "--llamacpp",
                 "--llama-bench", str(fake_bench), "--llamacpp-script", str(anchor), "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    cells = {(c["system"], c["batch_size"]): c["tok_per_s"] for c in result["cells"]}
    assert set(cells) == {(s, b) for s in ("tandem", "tandem-gguf") for b in (1, 2)}
    peer = result["llamacpp"]
    assert peer["tok_per_s"] == 50.0 and peer["gguf"] == str(gguf_model)
    assert peer["tandem_gguf_batch1"] == {"float32": cells[("tandem-gguf", 1)]}
    assert peer["tandem_gguf_over_llamacpp"]["float32"] == pytest.approx(cells[("tandem-gguf", 1)] / 50.0)
    assert peer["bound_tok_per_s"] == pytest.approx(result["machine"]["read_bandwidth_gb_s"] * 1e9 / 96576768)
    args = calls.read_text().split()
    threads = str(result["machine"]["threads"])
    assert args == ["-m", str(gguf_model), "-t", threads, "-p", "0", "-n", "4", "-r", "1", "-o", "json"]
    # tandem-gguf's cells are left out of the dtype's bound (its bytes are the file's, above)
    assert "tandem-gguf_batch1_fraction" not in result["bandwidth_bound"][0]


def test_a_missing_llama_bench_fails_before_any_cell(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_ANCHORS", str(tmp_path))  # nothing built there
    with pytest.raises(RuntimeError, match="no llama-bench: run `llamacpp_cpu.sh setup`"):
        main(["bench", "offline", "--model", str(tmp_path / "never-loaded"), "--llamacpp"])
