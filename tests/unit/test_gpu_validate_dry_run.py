"""tests/gpu/validate.py, the GPU validation script, dry-run on the CPU, so that it is known to work
before a session lent a GPU runs it (docs/gpu.md).

The dry run (``--device cpu --quick``: tiny models, batch 1 and 4, 8 tokens) must report every
check, pass those it runs, and write the throughput cells; the embedded model's checks are skipped
with the reason. The carried model's parts are staged one call at a time, as on the GPU machine,
and a damaged part is refused rather than used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "tests" / "gpu"
SCRIPT = GPU / "validate.py"
RUN = ["parity/tiny-llama", "parity/tiny-qwen2", "parity/tiny-opt", "parity/tiny-llama-gather",
       "parity/tiny-llama-flex", "speculative/tiny-ngram",
       "speculative/tiny-draft", "speculative/tiny-eagle3", "kv/preemption", "kv/preemption-draft"]
SYNC = ["sync/tiny-llama", "sync/tiny-eagle3"]  # CUDA only: skipped in the dry run
LORA = "lora/tiny-llama"
CORE = "core/tiny-llama"
EMBEDDED = ["embedded/weights", "parity/smollm2-135m", "speculative/smollm2-ngram", "speculative/smollm2-eagle3"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-validate")
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out),
               "--stash", str(out / "stash"), "--carry", str(out / "nothing-carried")]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert (out / "validate.json").is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads((out / "validate.json").read_text()), (out / "validate.txt").read_text()


def test_the_dry_run_reports_every_check_and_passes_those_it_runs(dry_run):
    proc, doc, text = dry_run
    assert proc.returncode == 0, text
    status = {c["name"]: (c["status"], c["detail"]) for c in doc["checks"]}
    assert list(status) == [*RUN, *SYNC, LORA, CORE, *EMBEDDED, "throughput"]
    assert all(status[name][0] == "passed" for name in [*RUN, LORA, CORE, "throughput"]), text
    assert all(status[name] == ("skipped", "--quick: tiny models only") for name in EMBEDDED)
    assert all(status[name] == ("skipped", "CUDA only: synchronisation is a CUDA notion") for name in SYNC)
    assert doc["summary"] == {"passed": 13, "failed": 0, "skipped": 6, "error": 0}
    assert doc["settings"]["device"] == "cpu" and doc["environment"]["missing_required"] == []
    assert "13 passed, 0 failed, 6 skipped, 0 error" in text


def test_speculation_preemption_and_the_core_process_were_exercised(dry_run):
    _, doc, _ = dry_run
    data = {c["name"]: c["data"] for c in doc["checks"]}
    for name in ("speculative/tiny-ngram", "speculative/tiny-draft", "speculative/tiny-eagle3"):
        assert data[name]["mismatches"] == [] and data[name]["num_draft_tokens"] > 0
    draft = data["speculative/tiny-draft"]
    assert 0 < draft["num_accepted_tokens"] < draft["num_draft_tokens"]
    for name in ("kv/preemption", "kv/preemption-draft"):
        assert data[name]["mismatches"] == [] and data[name]["num_preemptions"] > 0
    assert data["parity/tiny-llama"] == {"num_outputs": 5, "mismatches": []}
    lora = data[LORA]
    assert lora["mismatches"] == [] and lora["num_outputs"] == 9
    assert lora["adapters_change_output"] and lora["all_blocks_free"]
    core = data[CORE]
    assert core["mismatches"] == [] and core["errors"] == [] and core["num_draft_tokens"] > 0
    assert core["blocks_free_after_close"] and core["killed_stream_status"] == 503
    assert core["health_after_kill"].startswith("failed") and core["engine_pid"] > 0


def test_the_throughput_tables_have_every_system_at_every_batch_size(dry_run):
    _, doc, text = dry_run
    result = doc["throughput"]
    assert (result["device"], result["dtype"], result["batch_sizes"], result["output_len"]) == ("cpu", "float32",
                                                                                                [1, 4], 8)
    cells = {(c["system"], c["batch_size"]): c for c in result["cells"]}
    speculating = ["tandem+ngram", "tandem+eagle3", "tandem+eagle3 k=4"]
    assert result["speculating"] == speculating
    assert sorted(cells) == sorted((system, b) for system in ["tandem", "tandem-core", "transformers", *speculating]
                                   for b in (1, 4))
    for (system, batch_size), cell in cells.items():
        assert cell["output_tokens"] == batch_size * 8 and cell["tok_per_s"] > 0
    for ratio in result["ratios"]:
        tandem, hf = cells[("tandem", ratio["batch_size"])], cells[("transformers", ratio["batch_size"])]
        assert ratio["tandem_over_transformers"] == tandem["tok_per_s"] / hf["tok_per_s"]
        core = cells[("tandem-core", ratio["batch_size"])]
        assert ratio["core_over_tandem"] == core["tok_per_s"] / tandem["tok_per_s"]
        for system in speculating:
            assert ratio[f"{system}_over_tandem"] == cells[(system, ratio["batch_size"])]["tok_per_s"] / tandem[
                "tok_per_s"]
        fixed = cells[("tandem+eagle3 k=4", ratio["batch_size"])]
        assert ratio["verify_step_over_decode_step"] == fixed["mean_step_ms"] / tandem["mean_step_ms"]
    assert "decode throughput, tiny-llama (random) float32 on cpu" in text
    assert "speculation against plain decoding" in text and "verify/decode step" in text


@pytest.fixture
def gpu_modules(monkeypatch):
    monkeypatch.syspath_prepend(str(GPU))  # the script's folder, as when it runs
    import carry
    import checks

    yield carry, checks
    for name in ("carry", "checks", "report", "suite", "validate"):  # plain names: leave none behind
        sys.modules.pop(name, None)


def test_a_different_output_is_a_failed_comparison_that_says_where(gpu_modules):
    _, checks = gpu_modules
    assert checks.compare([[1, 2, 3]], [[1, 2, 3]]) == (True, {"num_outputs": 1, "mismatches": []})
    ok, data = checks.compare([[1, 2, 3], [4, 5, 6, 7]], [[1, 2, 3], [4, 5, 9, 7]])
    assert not ok
    assert data["mismatches"] == [{"prompt": 1, "first_mismatch": 2, "expected_len": 4, "got_len": 4,
                                   "expected": [6, 7], "got": [9, 7]}]
    ok, data = checks.compare([[1, 2]], [[1, 2, 3]])
    assert not ok and data["mismatches"][0]["first_mismatch"] == 2


def _pack(carry, tmp_path: Path, size: int, part_bytes: int) -> tuple[bytes, Path, list[dict]]:
    source = tmp_path / "model.gguf"
    payload = bytes((i * 7919) % 251 for i in range(size))
    source.write_bytes(payload)
    packed = tmp_path / "packed"
    parts = carry.split_file(source, packed, part_bytes, "model.gguf")
    manifest = {"model": {"file": "model.gguf", "sha256": hashlib.sha256(payload).hexdigest(), "parts": parts}}
    for part in parts:
        (packed / part["folder"] / carry.MANIFEST).write_text(json.dumps(manifest))
    return payload, packed, parts


def _call(tmp_path: Path, packed: Path, part: dict, stash: Path) -> subprocess.CompletedProcess:
    """One device call carrying one part: the script's --stage-only, as the GPU session runs it."""
    here = tmp_path / f"call-{part['folder']}"
    shutil.copytree(packed / part["folder"], here / part["folder"])
    return subprocess.run([sys.executable, str(SCRIPT), "--stage-only", "--stash", str(stash), "--carry", str(here)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_parts_carried_one_call_at_a_time_are_reassembled_and_checked(gpu_modules, tmp_path):
    carry, _ = gpu_modules
    payload, packed, parts = _pack(carry, tmp_path, 10_000, 3_000)
    assert [p["size"] for p in parts] == [3_000, 3_000, 3_000, 1_000]
    stash = tmp_path / "stash"
    for number, part in enumerate(parts, start=1):
        proc = _call(tmp_path, packed, part, stash)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        missing = list(range(number + 1, len(parts) + 1))
        assert f"parts here {list(range(1, number + 1))}, missing {missing}" in proc.stdout
    assert "model.gguf reassembled and checked" in proc.stdout
    assert (stash / "cache" / "gguf" / "model.gguf").read_bytes() == payload


def test_a_damaged_part_is_refused_and_the_model_not_assembled(gpu_modules, tmp_path):
    carry, _ = gpu_modules
    _, packed, parts = _pack(carry, tmp_path, 5_000, 2_500)
    damaged = packed / parts[1]["folder"] / parts[1]["name"]
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    stash = tmp_path / "stash"
    assert _call(tmp_path, packed, parts[0], stash).returncode == 0
    proc = _call(tmp_path, packed, parts[1], stash)
    assert proc.returncode == 1
    assert "sha256 differs from the manifest's; not kept" in proc.stdout and "missing [2]" in proc.stdout
    report = carry.stage(tmp_path / "nothing", stash)
    assert (report.parts_present, report.parts_missing, report.model_file) == ([1], [2], None)


def test_a_missing_package_is_reported_for_every_check_instead_of_a_crash(gpu_modules, tmp_path, monkeypatch, capsys):
    import validate

    monkeypatch.setitem(validate.REQUIRED, "tandem_no_such_module", "tandem-no-such-package")
    args = ["--device", "cpu", "--quick", "--out", str(tmp_path), "--stash", str(tmp_path / "stash"),
            "--carry", str(tmp_path / "nothing-carried")]
    assert validate.main(args) == 1
    doc = json.loads((tmp_path / "validate.json").read_text())
    assert doc["environment"]["missing_required"] == ["tandem-no-such-package"]
    assert [c["name"] for c in doc["checks"]] == [*RUN, *SYNC, LORA, CORE, *EMBEDDED, "throughput"]
    assert {c["status"] for c in doc["checks"]} == {"error"}
    assert all("cannot run without tandem-no-such-package" in c["detail"] for c in doc["checks"])
    assert doc["throughput"] is None
    assert "missing packages: tandem-no-such-package" in capsys.readouterr().out


def test_a_step_that_breaks_is_an_error_for_each_check_it_left_undone(gpu_modules, tmp_path, monkeypatch):
    import suite
    import validate

    def broken(work):
        raise OSError("disk full")

    monkeypatch.setattr(suite, "tiny_models", broken)
    args = ["--device", "cpu", "--quick", "--out", str(tmp_path), "--stash", str(tmp_path / "stash"),
            "--carry", str(tmp_path / "nothing-carried")]
    assert validate.main(args) == 1
    doc = json.loads((tmp_path / "validate.json").read_text())
    status = {c["name"]: (c["status"], c["detail"]) for c in doc["checks"]}
    assert list(status) == [*RUN, *SYNC, LORA, CORE, *EMBEDDED, "throughput"]
    assert all(status[name] == ("error", "OSError: disk full") for name in RUN)
    assert status["throughput"][0] == "error"  # no tiny model to measure
    assert all(status[name][0] == "skipped" for name in EMBEDDED)


def test_only_runs_the_checks_named_and_reports_the_rest_as_skipped(gpu_modules, tmp_path):
    import validate

    args = ["--device", "cpu", "--quick", "--out", str(tmp_path), "--stash", str(tmp_path / "stash"),
            "--carry", str(tmp_path / "nothing-carried"), "--only", "parity/tiny-qwen2,kv/"]
    assert validate.main(args) == 0
    doc = json.loads((tmp_path / "validate.json").read_text())
    status = {c["name"]: (c["status"], c["detail"]) for c in doc["checks"]}
    assert list(status) == [*RUN, *SYNC, LORA, CORE, *EMBEDDED, "throughput"]
    ran = {"parity/tiny-qwen2", "kv/preemption", "kv/preemption-draft"}
    assert all(status[name][0] == "passed" for name in ran)
    assert all(status[name] == ("skipped", "not selected (--only parity/tiny-qwen2,kv/)")
               for name in [*RUN, *SYNC, LORA, "throughput"] if name not in ran)


def run_gpu_script(name: str, tmp_path: Path, *args: str, env: dict | None = None) -> None:
    """Run ``tests/gpu/NAME`` on the CPU with nothing carried, its output under ``tmp_path``; it must exit 0."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / name), "--device", "cpu", *args,
                           "--stash", str(tmp_path / "stash"), "--carry", str(tmp_path / "nothing-carried"),
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_the_step_profile_runs_on_the_cpu_and_writes_its_rows(tmp_path):
    run_gpu_script("step_profile.py", tmp_path, "--batch-sizes", "1,3", "--steps", "2", "--warmup", "1")
    report = json.loads((tmp_path / "step_profile.json").read_text())
    assert [r["batch_size"] for r in report["rows"]] == [1, 3]
    assert all(r["wall_ms"] > 0 and "kernel_ms" not in r for r in report["rows"])  # no kernel time off CUDA
    assert "function calls" in report["cprofile_top"]  # cProfile's own header, at the largest batch


@pytest.mark.slow
def test_the_step_profile_times_lora_workloads_on_the_cpu(tmp_path):
    run_gpu_script("step_profile.py", tmp_path, "--batch-sizes", "4", "--steps", "2", "--warmup", "1", "--lora", "2")
    rows = json.loads((tmp_path / "step_profile.json").read_text())["rows"]
    assert [(r["batch_size"], r["workload"]) for r in rows] == [(4, "base"), (4, "one"), (4, "mixed")]
    assert all(r["wall_ms"] > 0 for r in rows)


@pytest.mark.slow
def test_the_handoff_profile_runs_on_the_cpu_with_py_spy(tmp_path):
    with_py_spy = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    run_gpu_script("handoff_profile.py", tmp_path, "--shape", "tiny", "--batch-sizes", "2,4", "--output-len", "48",
                   "--rate", "100", env=with_py_spy)
    rows = json.loads((tmp_path / "handoff_profile.json").read_text())["rows"]
    assert [r["batch_size"] for r in rows] == [2, 4]
    for row in rows:
        assert row["in_process"]["steps"] >= 48 and row["in_process"]["forward_ms"] > 0
        timeline = row["core"]["timeline"]  # the core's own record of the timed run
        assert timeline["num_steps"] >= 47 and timeline["mean_batch_size"] > 1
        assert set(row["core"]["profiles"]) == {"replica", "core"}  # py-spy sampled both processes
        assert row["core"]["profiles"]["core"]["samples"] > 0
