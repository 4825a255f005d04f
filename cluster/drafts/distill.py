"""``tandem draft distill``: prune the target, then distill it on the target's own text.

Contract of :func:`distill`:

- the loss is KL(target || student) on the target's full next-token distributions over
  the answer tokens of the target's own samples (:mod:`cluster.drafts.distill_data`);
- only the student's layers and final norm train; the tied embedding/head is the
  target's, frozen, so the draft stays compatible with the target's tokenizer;
- every ``checkpoint_every`` steps, and at the end, ``OUT/checkpoint/state.pt`` holds
  the student's own weights, the optimizer, the step (which fixes the data position:
  the row order is a pure function of seed and epoch) and the RNG state. Calling again
  with the same settings resumes from it; an uninterrupted run and a resumed one take
  the same steps on the same rows;
- when all steps are done, ``OUT`` is a Hugging Face folder (config.json with
  ``num_hidden_layers = layers``, model.safetensors, the target's tokenizer files) that
  :func:`cluster.models.loader.resolve_model` reads and that serves as
  ``speculative.draft_model``; ``OUT/distill_report.json`` records the layer choice and
  the loss curve.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from cluster.drafts.checkpoint import check_same_settings, load_state, save_state, warmup_cosine
from cluster.drafts.distill_data import Rows, SampleSettings, load_instruction_prompts, load_or_generate, split_rows
from cluster.drafts.prune import (LAYER_CHOICES, heldout_kl, kl_from_target_hidden, load_target, own_state_dict, prune,
                                  select_layers, target_hidden_states)
from cluster.models.loader import resolve_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")
LAYER_PROBE_ROWS = 16  # held-out rows used to compare layer choices before training


@dataclass(frozen=True)
class DistillSettings:
    """Everything that determines the result (``checkpoint_every`` aside)."""

    layers: int
    steps: int = 120
    batch_size: int = 8
    seq_len: int = 192
    lr: float = 3e-4
    warmup_steps: int = 10
    seed: int = 0
    num_samples: int = 192
    max_new_tokens: int = 128
    temperature: float = 0.8
    top_p: float = 0.95
    layer_choice: str = "auto"  # "auto" measures every choice in LAYER_CHOICES
    checkpoint_every: int = 25

    def __post_init__(self) -> None:
        for name in ("layers", "steps", "batch_size", "seq_len", "num_samples", "max_new_tokens",
                     "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.layer_choice != "auto" and self.layer_choice not in LAYER_CHOICES:
            raise ValueError(f"layer choice must be 'auto' or one of {', '.join(LAYER_CHOICES)}, "
                             f"got {self.layer_choice!r}")

    @property
    def samples(self) -> SampleSettings:
        return SampleSettings(self.num_samples, self.max_new_tokens, self.temperature, self.top_p, self.seed)

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to a tenth of ``lr``."""
        return warmup_cosine(step, self.steps, self.warmup_steps, self.lr, 0.1)


@dataclass(frozen=True)
class DistillResult:
    out: Path
    layers: list[int]
    step: int  # steps done so far (== settings.steps when finished)
    losses: list[float]  # training KL per step, from step 0
    finished: bool


def distill(target: str, out: Path, settings: DistillSettings, prompts: list[str] | None = None,
            stop_after: int | None = None, progress: bool = True, **engine_overrides) -> DistillResult:
    """Run (or resume) a distillation into ``out``; ``stop_after`` ends this call after that
    many steps without finishing (an interruption, for tests)."""
    out = Path(out)
    ckpt_dir = out / "checkpoint"
    source = resolve_model(target)
    engine_overrides.setdefault("dtype", "float32")
    engine_overrides.setdefault("max_num_seqs", 96)  # the samples are one continuous batch
    samples = load_or_generate(ckpt_dir / "samples.json", target, prompts or load_instruction_prompts(),
                               settings.samples, **engine_overrides)
    teacher = load_target(source)
    pad_id = teacher.config.pad_token_id if teacher.config.pad_token_id is not None else 0
    train_rows, held_rows = split_rows(samples, settings.seq_len, pad_id)
    probe = held_rows if len(held_rows) else train_rows
    probe = probe.batch(list(range(min(LAYER_PROBE_ROWS, len(probe)))))

    state = load_state(ckpt_dir / "state.pt")
    if state is not None:
        check_same_settings(state["settings"], settings, ckpt_dir)
        layers, report = state["layers"], state["report"]
    else:
        layers, report = _choose_layers(teacher, settings, probe)
    student = prune(teacher, layers)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    losses: list[float] = []
    step = 0
    if state is not None:
        student.load_state_dict(state["own_weights"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        step, losses = state["step"], list(state["losses"])
    else:
        torch.manual_seed(settings.seed)
        report["heldout_kl_start"] = heldout_kl(teacher, student, held_rows, settings.batch_size)

    end = settings.steps if stop_after is None else min(settings.steps, step + stop_after)
    bar = _progress(progress, settings.steps, step)
    student.train()
    if step < end:
        hidden = _cached_hidden(ckpt_dir / "target_hidden.pt", teacher, train_rows, settings.batch_size)
    while step < end:
        index = batch_rows(step, settings.batch_size, len(train_rows), settings.seed)
        batch = train_rows.batch(index)
        for group in optimizer.param_groups:
            group["lr"] = settings.lr_at(step)
        loss = kl_from_target_hidden(teacher, hidden[index][batch.loss_mask], student, batch.token_ids,
                                     batch.loss_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        step += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(kl=f"{losses[-1]:.3f}")
        if step % settings.checkpoint_every == 0 or step == end:
            save_state(ckpt_dir / "state.pt", settings=asdict(settings), layers=layers, report=report,
                       own_weights=_own(student), optimizer=optimizer.state_dict(), step=step,
                       losses=losses, rng=torch.get_rng_state())
    if bar is not None:
        bar.close()
    student.eval()
    finished = step >= settings.steps
    if finished:
        report["heldout_kl_end"] = heldout_kl(teacher, student, held_rows, settings.batch_size)
        _write_folder(student, source.path, out, settings, layers, report, losses)
    return DistillResult(out, layers, step, losses, finished)


def batch_rows(step: int, batch_size: int, num_rows: int, seed: int) -> list[int]:
    """Row indices of ``step``'s batch: epochs of seeded permutations, so a step number is a
    data position and a resumed run reads exactly the rows an uninterrupted one would."""
    rows = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, index = divmod(position, num_rows)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        rows.append(int(torch.randperm(num_rows, generator=generator)[index]))
    return rows


def _cached_hidden(path: Path, teacher, rows: Rows, batch_size: int) -> torch.Tensor:
    """The target's final hidden states of the training rows, computed once per run."""
    saved = load_state(path)
    if saved is not None:
        return saved["hidden"]
    hidden = target_hidden_states(teacher, rows, batch_size)
    save_state(path, hidden=hidden)
    return hidden


def _choose_layers(teacher, settings: DistillSettings, probe: Rows) -> tuple[list[int], dict]:
    """Layers for the student: the given choice, or the one with the lowest KL on ``probe``."""
    num_layers = teacher.config.num_hidden_layers
    choices = LAYER_CHOICES if settings.layer_choice == "auto" else (settings.layer_choice,)
    candidates = {c: select_layers(num_layers, settings.layers, c) for c in choices}
    measured = {}
    for choice, layers in candidates.items():
        if layers in [candidates[c] for c in measured]:  # same layers as a choice already measured
            measured[choice] = measured[next(c for c in measured if candidates[c] == layers)]
            continue
        measured[choice] = heldout_kl(teacher, prune(teacher, layers), probe, settings.batch_size)
    best = min(measured, key=measured.get) if len(measured) > 1 else choices[0]
    report = {"layer_choice": best, "layer_candidates": {c: {"layers": candidates[c], "kl": measured[c]}
                                                         for c in choices}}
    return candidates[best], report


def _own(student) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in own_state_dict(student).items()}


def _progress(enabled: bool, total: int, initial: int):
    if not enabled:
        return None
    return tqdm(total=total, initial=initial, desc="distilling", unit="step")


def _write_folder(student, target_dir: Path, out: Path, settings: DistillSettings, layers: list[int],
                  report: dict, losses: list[float]) -> None:
    student.config.use_cache = True
    student.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            shutil.copyfile(target_dir / name, out / name)
    tail = losses[-10:]
    report = {**report, "settings": asdict(settings), "layers": layers, "losses": losses,
              "train_kl_first": losses[0] if losses else None,
              "train_kl_last10_mean": sum(tail) / len(tail) if tail else None}
    tmp = out / f".distill_report.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out / "distill_report.json")

