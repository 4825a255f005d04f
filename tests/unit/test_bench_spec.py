"""``tandem bench spec`` end to end on a tiny random Llama (no download, no vLLM, no timing assertions)."""

from __future__ import annotations

import json

import pytest

from cluster.bench.spec_cells import RequestTiming, SpecCounts, pool_rounds
from cluster.profiling.edit_prompts import PASSAGES, TASKS, build_prompt_ids
from cluster.cli import main
from cluster.models.tiny import save_tiny_model, save_tiny_tokenizer, tiny_llama_config


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    # The character-level tokenizer turns each passage prompt into ~500 tokens.
    save_tiny_model(tiny_llama_config(max_position_embeddings=2048), folder)
    save_tiny_tokenizer(folder)
    return folder


def test_every_cell_with_its_counters(tiny_folder, tmp_path):
    out = tmp_path / "spec.json"
    code = main(["bench", "spec", "--model", str(tiny_folder), "--batch-sizes", "1,2", "--ks", "0,2",
                 "--output-len", "6", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    settings = result["settings"]
    assert settings["prompt_format"] == "plain" and settings["method"] == "ngram"
    assert settings["num_prompts"] == 16 and len(settings["prompt_lens"]) == 16
    cells = {(c["batch_size"], c["k"]): c for c in result["tandem"]["cells"]}
    assert set(cells) == {(b, k) for b in (1, 2) for k in (0, 2)}
    for (batch_size, k), cell in cells.items():
        assert cell["system"] == "tandem" and cell["num_requests"] == 16
        assert cell["output_tokens"] == 16 * 6
        # measured fields are present as numbers (their values are timings: not asserted)
        assert all(isinstance(cell[key], float) for key in ("seconds", "tok_per_s", "tpot_ms", "ttft_ms"))
        # Tokens after the first take at least one target step each and at most k + 1 per step.
        assert 1 <= cell["tokens_per_step"] <= k + 1
        if k == 0:
            assert cell["num_drafts"] == 0 and cell["num_draft_tokens"] == 0
            assert cell["acceptance_rate"] is None and cell["mean_acceptance_length"] is None
            assert cell["speedup_vs_k0"] == 1.0
        else:
            # Prompt lookup always finds a 1-gram in ~500 characters of English text.
            assert cell["num_drafts"] > 0 and 0 < cell["num_draft_tokens"] <= 2 * cell["num_drafts"]
            assert 0 <= cell["acceptance_rate"] <= 1
            assert 1 <= cell["mean_acceptance_length"] <= k + 1
            assert sum(cell["accepted_per_position"]) == cell["num_accepted_tokens"]
            assert cell["speedup_vs_k0"] > 0


def test_prompts_hold_the_passage_and_match_the_chat_template(tiny_folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_folder)
    ids, fmt = build_prompt_ids(tokenizer, 5)
    assert fmt == "plain" and len(ids) == 5
    text = tokenizer.decode(ids[4], skip_special_tokens=True)
    assert PASSAGES[4] in text and TASKS[0] in text
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    ids, fmt = build_prompt_ids(tokenizer, 1)
    assert fmt == "chat_template"
    text = tokenizer.decode(ids[0])  # the tiny tokenizer has no newline: "\n" reads back as <unk>
    assert text.startswith(f"<user>{TASKS[0]}") and text.endswith(f"{PASSAGES[0]}<assistant>")
    assert ids[0][0] != tokenizer.bos_token_id  # a template holds any BOS it wants; none is added


def test_counter_deltas_pad_positions():
    before = SpecCounts(2, 4, 1, (1,))
    after = SpecCounts(5, 10, 6, (3, 2, 1))
    assert after.minus(before) == SpecCounts(3, 6, 5, (2, 2, 1))


@pytest.mark.parametrize("flag,value", [("--ks", "0,17"), ("--ks", "a"), ("--batch-sizes", "0"),
                                        ("--method", "eagle")])
def test_bad_arguments_are_rejected(flag, value, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "spec", flag, value])
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and value in err


def test_draft_method_needs_a_draft_model(tiny_folder, capsys):
    assert main(["bench", "spec", "--model", str(tiny_folder), "--method", "draft", "--ks", "0"]) == 2
    assert "--draft-model" in capsys.readouterr().err


def test_batch_invariant_both_measures_each_cell_twice_and_keeps_greedy_output(tiny_folder, tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--model", str(tiny_folder), "--batch-sizes", "1,3", "--ks", "0,3",
                 "--output-len", "8", "--num-prompts", "6", "--dtype", "bfloat16", "--batch-invariant", "both",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    usual, invariant = result["tandem"]["cells"], result["tandem_batch_invariant"]["cells"]
    assert {c["system"] for c in usual} == {"tandem"} and {c["system"] for c in invariant} == {"tandem-batch-invariant"}
    assert [(c["batch_size"], c["k"]) for c in invariant] == [(1, 0), (1, 3), (3, 0), (3, 3)]
    # The mode's promise, at every batch size: speculation gives plain decoding's greedy tokens.
    assert all(c["identical_to_k0"] == 6 for c in invariant)
    cost = result["batch_invariant_cost"]
    assert [(r["batch_size"], r["k"]) for r in cost] == [(1, 0), (1, 3), (3, 0), (3, 3)]
    for row, u, i in zip(cost, usual, invariant):
        assert row["invariant_over_usual"] == pytest.approx(i["tok_per_s"] / u["tok_per_s"])
        assert row["usual_identical_to_k0"] == u["identical_to_k0"]
    assert "What model.batch_invariant costs" in capsys.readouterr().out


def test_repeats_pool_every_round_of_a_cell(tiny_folder, tmp_path):
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--model", str(tiny_folder), "--batch-sizes", "2", "--ks", "0,3",
                 "--output-len", "5", "--num-prompts", "4", "--repeats", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["repeats"] == 3
    for cell in result["tandem"]["cells"]:
        assert cell["num_requests"] == 3 * 4 and cell["output_tokens"] == 3 * 4 * 5
        assert len(cell["repeat_tok_per_s"]) == 3
        assert cell["identical_to_k0"] == 3 * 4  # each round against k = 0 in the same round
    drafted = result["tandem"]["cells"][1]
    assert drafted["num_draft_tokens"] > 0 and sum(drafted["accepted_per_position"]) == drafted["num_accepted_tokens"]


def test_spec_counts_add_up_across_positions():
    a = SpecCounts(2, 5, 3, (2, 1))
    b = SpecCounts(1, 4, 4, (1, 1, 1, 1))
    assert a.plus(b) == SpecCounts(3, 9, 7, (3, 2, 1, 1))
    assert a.plus(b).minus(b) == SpecCounts(2, 5, 3, (2, 1, 0, 0))


def test_pooled_rounds_are_all_tokens_over_all_seconds():
    """Fixed numbers, no clock: two rounds of 2 requests x 5 tokens, in 2 s and 0.5 s."""
    def round_(seconds, counts):
        return [RequestTiming(0.1, 0.4, 5, 4), RequestTiming(0.1, 0.4, 5, 4)], seconds, counts

    cell = pool_rounds("tandem", "ngram", 2, 3, 5, [round_(2.0, SpecCounts(2, 6, 3, (2, 1))),
                                                     round_(0.5, SpecCounts(1, 3, 3, (1, 1, 1)))])
    assert (cell.num_requests, cell.output_tokens, cell.seconds) == (4, 20, 2.5)
    assert cell.tok_per_s == 20 / 2.5 and cell.repeat_tok_per_s == [5.0, 20.0]
    assert (cell.num_draft_tokens, cell.num_accepted_tokens, cell.accepted_per_position) == (9, 6, [3, 2, 1])


def test_verification_both_measures_coupled_and_rejection_side_by_side(tiny_folder, tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--model", str(tiny_folder), "--batch-sizes", "1,3", "--ks", "0,3",
                 "--output-len", "8", "--num-prompts", "6", "--dtype", "float32", "--temperature", "0.8",
                 "--verification", "both", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["sampling"].startswith("temperature 0.8")
    coupled, rejection = result["tandem"]["cells"], result["tandem_rejection"]["cells"]
    assert {c["system"] for c in rejection} == {"tandem-rejection"}
    # Seeded sampling with coupled verification: every request keeps plain decoding's tokens.
    assert all(c["identical_to_k0"] == 6 for c in coupled)
    cost = result["verification_cost"]
    assert [(r["batch_size"], r["k"]) for r in cost] == [(1, 0), (1, 3), (3, 0), (3, 3)]
    for row, c, r in zip(cost, coupled, rejection):
        assert row["coupled_over_rejection"] == pytest.approx(c["tok_per_s"] / r["tok_per_s"])
        assert row["rejection_acceptance_rate"] == r["acceptance_rate"]
    assert "Coupled verification against rejection sampling" in capsys.readouterr().out


def test_verification_both_needs_sampling(tiny_folder, capsys):
    assert main(["bench", "spec", "--model", str(tiny_folder), "--ks", "0", "--verification", "both"]) == 2
    assert "--temperature" in capsys.readouterr().err


def test_adaptive_adds_a_cell_per_batch_size_run_by_the_controller(tiny_folder, tmp_path, capsys):
    out = tmp_path / "spec.json"
    profile = "configs/profiles/cpu-2core-avx512-smollm2-135m-ngram-capped-bf16.json"
    assert main(["bench", "spec", "--model", str(tiny_folder), "--batch-sizes", "1,2", "--ks", "0,2",
                 "--output-len", "5", "--num-prompts", "4", "--adaptive", profile, "--json", str(out)]) == 0
    cells = json.loads(out.read_text())["tandem"]["cells"]
    assert [(c["batch_size"], c["k"]) for c in cells] == [(1, 0), (1, 2), (1, -1), (2, 0), (2, 2), (2, -1)]
    for cell in cells:
        assert cell["num_requests"] == 4 and cell["output_tokens"] == 4 * 5
        assert cell["speedup_vs_k0"] > 0
    adaptive = [c for c in cells if c["k"] == -1]
    # the controller picks k itself, up to the largest of --ks: at most 3 tokens a step
    assert all(1 <= c["tokens_per_step"] <= 3 for c in adaptive)
    assert "adaptive" in capsys.readouterr().out
    assert main(["bench", "spec", "--model", str(tiny_folder), "--adaptive", str(tmp_path / "missing.json")]) != 0
    assert "missing.json does not exist" in capsys.readouterr().err


def test_warm_tree_seeds_every_cell_with_answers_to_other_prompts(tiny_folder, tmp_path, capsys):
    pytest.importorskip("arctic_inference", reason="arctic-inference is built by `make install`")
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--model", str(tiny_folder), "--method", "suffix", "--batch-sizes", "2",
                 "--ks", "0,4", "--output-len", "6", "--num-prompts", "4", "--warm-tree", "4",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["warm_tree"] == 4 and len(result["settings"]["prompt_lens"]) == 4
    cells = {c["k"]: c for c in result["tandem"]["cells"]}
    assert cells[4]["num_requests"] == 4 and cells[4]["identical_to_k0"] == 4
    # refused: trees to seed without suffix drafts; other prompts the set does not have
    assert main(["bench", "spec", "--model", str(tiny_folder), "--ks", "0", "--warm-tree", "4"]) == 2
    assert "needs --method suffix" in capsys.readouterr().err
    assert main(["bench", "spec", "--model", str(tiny_folder), "--method", "suffix", "--ks", "0",
                 "--num-prompts", "60", "--warm-tree", "10"]) == 2
    assert "too few prompts" in capsys.readouterr().err
