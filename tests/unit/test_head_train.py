"""``tandem draft train``: made prompts, the draft vocabulary, resumable deterministic training and a
head folder in the published layout with its report."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from cluster.drafts.head_data import Text, extract_features, held_out_prompts
from cluster.drafts.head_prompts import EDIT_TASKS, edit_prompts, open_prompts
from cluster.drafts.head_train import HeadSettings, choose_draft_vocab, chosen_texts, grouped_batch, train_head
from cluster.drafts.checkpoint import load_state
from cluster.models.eagle3 import load_head

SMALL = dict(steps=8, batch_size=4, seq_len=512, lr=3e-3, warmup_steps=2, ttt_steps=2, draft_vocab=64, num_open=6,
             max_new_tokens=12, checkpoint_every=100)


def test_made_prompts_are_distinct_seeded_and_never_the_benchmarks():
    first = open_prompts(200, seed=0)
    assert len(set(first)) == 200 and first == open_prompts(200, seed=0) and first != open_prompts(200, seed=1)
    edits = edit_prompts(["A passage.", "Another one."], seed=0)
    assert all(any(e.startswith(task) for task in EDIT_TASKS) for e in edits)
    assert not set(held_out_prompts()) & set(first + edits)


def test_the_draft_vocabulary_is_the_targets_most_chosen_tokens():
    labels = [torch.tensor([5, 5, 5, 9, 9, 1]), torch.tensor([9, 7])]
    assert choose_draft_vocab(labels, vocab_size=12, size=2).tolist() == [5, 9]
    assert choose_draft_vocab(labels, vocab_size=12, size=3).tolist() == [1, 5, 9]  # a tie goes to the lower id


def test_batches_group_texts_of_like_length_and_cover_each_epoch_once():
    lengths = [30, 5, 17, 6, 29, 18, 4, 31, 16]
    epoch = [grouped_batch(step, 3, lengths, seed=0) for step in range(3)]
    assert sorted(i for batch in epoch for i in batch) == list(range(9))
    assert sorted(sorted(lengths[i] for i in batch) for batch in epoch) == [[4, 5, 6], [16, 17, 18], [29, 30, 31]]
    assert [grouped_batch(step, 3, lengths, seed=0) for step in range(3, 6)] != epoch  # another order next epoch
    assert grouped_batch(4, 3, lengths, seed=0) == grouped_batch(4, 3, lengths, seed=0)


def test_states_of_texts_in_padded_batches_equal_one_text_at_a_time(tiny_llama_dir):
    from cluster.drafts.prune import load_target
    from cluster.models.loader import resolve_model

    model = load_target(resolve_model(str(tiny_llama_dir))).eval()
    gen = torch.Generator().manual_seed(0)
    texts = [Text(torch.randint(3, 200, (n,), generator=gen).tolist(), 2) for n in (9, 3, 17, 5, 12)]
    batched = extract_features(model, texts, (0, 1), None, batch_size=3)
    single = extract_features(model, texts, (0, 1), None, batch_size=1)
    for text, a, b, la, lb in zip(texts, batched.aux, single.aux, batched.labels, single.labels):
        assert a.shape == (len(text.token_ids), 2 * model.config.hidden_size) and a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(la, lb)


def test_a_capped_run_trains_on_a_seeded_choice_of_the_texts():
    texts = [Text([i, i + 1], 1) for i in range(10)]
    chosen = chosen_texts(texts, 4, seed=0)
    assert len(chosen) == 4 and chosen == chosen_texts(texts, 4, seed=0) != chosen_texts(texts, 4, seed=1)
    assert chosen == sorted(chosen, key=lambda t: t.token_ids[0])  # in their order
    assert chosen_texts(texts, 0, seed=0) == texts == chosen_texts(texts, 10, seed=0)


def test_training_writes_a_loadable_head_and_its_report(tiny_llama_dir, tmp_path):
    result = train_head(str(tiny_llama_dir), tmp_path / "head", HeadSettings(**SMALL), progress=False, device="cpu")
    assert result.finished and result.step == 8
    assert sum(result.losses[-3:]) < sum(result.losses[:3])
    head = load_head(tmp_path / "head")
    assert head.config.draft_vocab_size == 64
    assert load_file(str(tmp_path / "head" / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    state = load_state(tmp_path / "head" / "checkpoint" / "state.pt")
    assert torch.equal(head.to_target_ids(torch.arange(64)), state["vocab_ids"])
    report = json.loads((tmp_path / "head" / "head_report.json").read_text())
    assert len(report["acceptance_per_position"]) == 2 and report["held_out_places"] > 0
    assert 1.0 <= report["mean_acceptance_length"] <= 3.0


def test_a_resumed_run_takes_the_steps_an_uninterrupted_one_takes(tiny_llama_dir, tmp_path):
    settings = HeadSettings(**SMALL)
    whole = train_head(str(tiny_llama_dir), tmp_path / "whole", settings, progress=False, device="cpu")
    first = train_head(str(tiny_llama_dir), tmp_path / "split", settings, stop_after=3, progress=False, device="cpu")
    assert not first.finished and first.step == 3
    resumed = train_head(str(tiny_llama_dir), tmp_path / "split", settings, progress=False, device="cpu")
    assert resumed.finished and resumed.losses == whole.losses
    a = load_state(tmp_path / "whole" / "checkpoint" / "state.pt")["head"]
    b = load_state(tmp_path / "split" / "checkpoint" / "state.pt")["head"]
    assert all(torch.equal(a[k], b[k]) for k in a)
