"""`tandem draft distill` on a tiny random-weight Llama: the loss falls, the run resumes
to the same result, the output loads, and speculation with it keeps greedy output exact."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from cluster.cli import main
from cluster.drafts.distill import DistillSettings, batch_rows, distill
from cluster.drafts.prune import select_layers
from cluster.shared.sampling_params import SamplingParams
from cluster.models.hf_folder import iter_weights
from cluster.models.loader import load_hf_config, load_tokenizer, resolve_model
from cluster.models.tiny import save_tiny_model, save_tiny_tokenizer, tiny_llama_config
from tests.engine_helpers import make_engine, run_to_completion

PROMPTS = [f"Tell me about item {i} and {chr(97 + i)}." for i in range(16)]
SETTINGS = DistillSettings(layers=2, steps=12, batch_size=4, seq_len=40, lr=3e-3, seed=3,
                           num_samples=32, max_new_tokens=24, checkpoint_every=4)
CLI_ARGS = ["--layers", "2", "--steps", "12", "--batch-size", "4", "--seq-len", "40", "--lr", "3e-3",
            "--seed", "3", "--num-samples", "32", "--max-new-tokens", "24", "--checkpoint-every", "4"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_target")
    save_tiny_model(tiny_llama_config(num_hidden_layers=4), path, seed=5)
    save_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def distilled(target_dir, tmp_path_factory, monkeypatch_module):
    """One uninterrupted run through the CLI (the shipped prompts replaced by tiny ones)."""
    out = tmp_path_factory.mktemp("draft")
    monkeypatch_module.setattr("cluster.drafts.distill.load_instruction_prompts", lambda: PROMPTS)
    assert main(["draft", "distill", str(target_dir), str(out), *CLI_ARGS]) == 0
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_select_layers():
    assert select_layers(30, 4, "first") == [0, 1, 2, 3]
    assert select_layers(30, 4, "even") == [0, 10, 19, 29]
    assert select_layers(30, 4, "first-last") == [0, 1, 2, 29]
    assert select_layers(30, 1, "first-last") == [29]
    with pytest.raises(ValueError, match="between 1 and"):
        select_layers(30, 31, "first")


def test_batch_rows_cover_each_epoch_once():
    rows = [r for step in range(6) for r in batch_rows(step, 4, 8, seed=1)]
    assert sorted(rows[:8]) == list(range(8)) and sorted(rows[8:16]) == list(range(8))
    assert rows[:8] != rows[8:16]  # a new order each epoch


def test_distillation_lowers_the_loss_and_writes_a_loadable_model(distilled, target_dir):
    report = json.loads((distilled / "distill_report.json").read_text())
    losses = report["losses"]
    assert len(losses) == SETTINGS.steps
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3
    assert report["heldout_kl_end"] < report["heldout_kl_start"]
    assert set(report["layer_candidates"]) == {"first", "even", "first-last"}
    assert report["layers"] == report["layer_candidates"][report["layer_choice"]]["layers"]

    source = resolve_model(str(distilled))
    assert load_hf_config(source).num_hidden_layers == 2
    names = {name for name, _ in iter_weights(source)}
    assert "model.embed_tokens.weight" in names and "model.layers.1.mlp.down_proj.weight" in names
    assert not any(n.startswith("model.layers.2.") for n in names)
    assert load_tokenizer(source).get_vocab() == load_tokenizer(resolve_model(str(target_dir))).get_vocab()


def test_embedding_is_the_targets(distilled, target_dir):
    target = dict(iter_weights(resolve_model(str(target_dir))))
    draft = dict(iter_weights(resolve_model(str(distilled))))
    torch.testing.assert_close(draft["model.embed_tokens.weight"], target["model.embed_tokens.weight"],
                               rtol=0, atol=0)
    layers = json.loads((distilled / "distill_report.json").read_text())["layers"]
    trained = draft["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(trained, target[f"model.layers.{layers[0]}.self_attn.q_proj.weight"])


def test_interrupted_run_resumes_to_the_same_result(distilled, target_dir, tmp_path):
    shutil.copytree(distilled / "checkpoint", tmp_path / "checkpoint")
    (tmp_path / "checkpoint" / "state.pt").unlink()  # keep the samples, start training over
    first = distill(str(target_dir), tmp_path, SETTINGS, prompts=PROMPTS, stop_after=5, progress=False)
    assert (first.step, first.finished) == (5, False)
    assert not (tmp_path / "config.json").exists()
    second = distill(str(target_dir), tmp_path, SETTINGS, prompts=PROMPTS, progress=False)
    assert (second.step, second.finished) == (SETTINGS.steps, True)
    assert second.losses[:5] == first.losses
    expected = json.loads((distilled / "distill_report.json").read_text())["losses"]
    assert second.losses == pytest.approx(expected, rel=1e-5)
    resumed = dict(iter_weights(resolve_model(str(tmp_path))))
    for name, tensor in iter_weights(resolve_model(str(distilled))):
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-5, atol=1e-6)


def test_resume_with_other_settings_is_refused(distilled, target_dir, tmp_path):
    shutil.copytree(distilled / "checkpoint", tmp_path / "checkpoint")
    with pytest.raises(ValueError, match="other settings.*lr"):
        distill(str(target_dir), tmp_path, DistillSettings(**{**SETTINGS.__dict__, "lr": 1e-3}),
                prompts=PROMPTS, progress=False)


def test_speculation_with_the_distilled_draft_keeps_greedy_output(distilled, target_dir):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[5 + i, 40 + 3 * i, 77, 9 + i] for i in range(5)]
    expected = run_to_completion(make_engine(target_dir, num_blocks=128), prompts, greedy)
    engine = make_engine(target_dir, num_blocks=128, method="draft", draft_model=str(distilled),
                         num_speculative_tokens=3)
    assert run_to_completion(engine, prompts, greedy) == expected
    spec = engine.stats().spec
    assert 0 < spec.num_accepted_tokens <= spec.num_draft_tokens
