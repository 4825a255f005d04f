"""``tandem draft train``: an EAGLE-3 head for a Llama-family target, trained on the target's own text.

Contract of :func:`train_head`:

- the texts are the target's answers to made prompts (:mod:`cluster.drafts.head_data`), the
  inputs its aux hidden states and the labels its greedy choices, all computed once;
- the draft vocabulary is the ``draft_vocab`` tokens the target chooses most often in the
  training texts (``d2t`` maps them back); ``lm_head`` starts as the target's output rows of
  those tokens, the rest of the head from a seeded random init; the embedding is the target's,
  frozen and not saved;
- training unrolls ``ttt_steps`` draft steps (:mod:`cluster.drafts.head_ttt`); the row order is
  a pure function of seed and step, and ``OUT/checkpoint/state.pt`` (every
  ``checkpoint_every`` steps and at the end) holds weights, optimizer, step and RNG state, so a
  run resumed with the same settings takes the same steps as an uninterrupted one;
- when done, ``OUT`` is a published-layout EAGLE-3 folder in bfloat16 (:func:`cluster.models.eagle3.save_head`)
  and ``OUT/head_report.json`` holds the loss curve and the held-out acceptance per draft position
  on ``tandem bench spec``'s prompts, which training never sees.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from cluster.drafts.checkpoint import check_same_settings, load_state, save_state, warmup_cosine
from cluster.drafts.head_data import Features, Text, TextSettings, load_or_extract, load_or_generate_texts
from cluster.drafts.head_ttt import loss as ttt_loss
from cluster.drafts.head_ttt import step_hits, unrolled_logits
from cluster.drafts.prune import load_target
from cluster.models.eagle3 import Eagle3Head, HeadConfig, default_aux_layers, save_head
from cluster.models.loader import resolve_model


@dataclass(frozen=True)
class HeadSettings:
    """Everything that determines the result (``checkpoint_every`` aside)."""

    steps: int = 2000
    batch_size: int = 8
    seq_len: int = 384
    lr: float = 6e-4
    warmup_steps: int = 50
    ttt_steps: int = 4
    decay: float = 0.8
    draft_vocab: int = 8192
    compute_dtype: str = "bfloat16"  # matrix products under autocast (float32: none); weights stay float32
    seed: int = 0
    num_open: int = 1600
    max_texts: int = 0  # train on this many of the texts (a seeded choice; 0: all of them)
    max_new_tokens: int = 192
    temperature: float = 0.8
    checkpoint_every: int = 50

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "ttt_steps", "draft_vocab", "num_open", "max_new_tokens",
                     "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_open < 2:
            raise ValueError(f"num_open must be at least 2 (round two edits half of round one), got {self.num_open}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.compute_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"compute_dtype must be bfloat16 or float32, got {self.compute_dtype!r}")

    @property
    def texts(self) -> TextSettings:
        return TextSettings(self.num_open, self.max_new_tokens, self.temperature, self.seed)

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to a twentieth of ``lr``."""
        return warmup_cosine(step, self.steps, self.warmup_steps, self.lr, 0.05)


@dataclass(frozen=True)
class HeadResult:
    out: Path
    step: int
    losses: list[float]
    finished: bool


class Batches:
    """Texts cut to ``seq_len`` and right-padded into rows; ``answer`` marks positions whose
    label follows an answer token (the prompt is given, its continuation is not drafted)."""

    def __init__(self, texts: list[Text], features: Features, seq_len: int) -> None:
        self.texts, self.features, self.seq_len = texts, features, seq_len

    def __len__(self) -> int:
        return len(self.texts)

    def rows(self, index: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(aux [B, T, A] bfloat16, tokens [B, T], labels [B, T], answer [B, T] bool)."""
        length = min(self.seq_len, max(len(self.texts[i].token_ids) for i in index))
        width = self.features.aux[index[0]].shape[-1]
        aux = torch.zeros(len(index), length, width, dtype=torch.bfloat16)
        tokens = torch.zeros(len(index), length, dtype=torch.int64)
        labels = torch.zeros(len(index), length, dtype=torch.int64)
        answer = torch.zeros(len(index), length, dtype=torch.bool)
        for r, i in enumerate(index):
            text = self.texts[i]
            n = min(length, len(text.token_ids))
            aux[r, :n] = self.features.aux[i][:n]
            tokens[r, :n] = torch.tensor(text.token_ids[:n])
            labels[r, :n] = self.features.labels[i][:n]
            # label u (the choice after x[u]) is scored when x[u] is a prompt's last token or an answer
            # token, and x[u] is not the text's last (its input x[u] exists for every step's shift).
            answer[r, max(text.prompt_len - 1, 0) : n - 1] = True
        return aux, tokens, labels, answer


def grouped_batch(step: int, batch_size: int, lengths: list[int], seed: int) -> list[int]:
    """Texts of ``step``'s batch: each epoch cuts the texts, sorted by length, into batches of
    ``batch_size`` and visits them in a seeded order, so a batch pads little and a step number
    is a data position (a resumed run reads what an uninterrupted one would)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    epoch, index = divmod(step, len(batches))
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return batches[int(torch.randperm(len(batches), generator=generator)[index])]


def chosen_texts(texts: list[Text], max_texts: int, seed: int) -> list[Text]:
    """``max_texts`` of ``texts`` (a seeded choice, in their order), or all of them (0, or no fewer)."""
    if max_texts <= 0 or max_texts >= len(texts):
        return texts
    keep = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed))[:max_texts]
    return [texts[i] for i in sorted(keep.tolist())]


def choose_draft_vocab(labels: list[torch.Tensor], vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` target ids chosen most often (ties by id), ascending."""
    counts = torch.bincount(torch.cat(labels), minlength=vocab_size)
    size = min(size, vocab_size)
    top = torch.sort(counts, descending=True, stable=True).indices[:size]
    return torch.sort(top).values


def head_config(target_config, draft_vocab: int) -> HeadConfig:
    layers = target_config.num_hidden_layers
    hidden = target_config.hidden_size
    heads = target_config.num_attention_heads
    rope = getattr(target_config, "rope_parameters", None) or {}
    return HeadConfig(
        hidden_size=hidden, num_heads=heads, num_kv_heads=target_config.num_key_value_heads,
        head_dim=getattr(target_config, "head_dim", None) or hidden // heads,
        intermediate_size=target_config.intermediate_size, rms_norm_eps=target_config.rms_norm_eps,
        vocab_size=target_config.vocab_size, draft_vocab_size=draft_vocab, target_hidden_size=hidden,
        aux_layer_ids=default_aux_layers(layers), rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_position_embeddings=target_config.max_position_embeddings,
    )


def new_head(config: HeadConfig, vocab_ids: torch.Tensor, target_head: torch.Tensor, seed: int) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(config)
    with torch.no_grad():
        head.lm_head.weight.copy_(target_head[vocab_ids])
        head.d2t.copy_(vocab_ids - torch.arange(len(vocab_ids)))
    return head


def train_head(target: str, out: Path, settings: HeadSettings, stop_after: int | None = None,
               progress: bool = True, **engine_overrides) -> HeadResult:
    """Run (or resume) training into ``out``; ``stop_after`` ends this call after that many steps."""
    out = Path(out)
    ckpt = out / "checkpoint"
    source = resolve_model(target)
    engine_overrides.setdefault("max_num_seqs", 128)
    engine_overrides.setdefault("dtype", "bfloat16")  # the dtype heads are served beside
    texts = load_or_generate_texts(ckpt / "texts.json", target, settings.texts, progress, **engine_overrides)
    model = load_target(source).to(torch.bfloat16)
    aux_layers = default_aux_layers(model.config.num_hidden_layers)
    train_texts = chosen_texts(texts.train, settings.max_texts, settings.seed)
    train_features = load_or_extract(ckpt / "features.pt", model, train_texts, aux_layers,
                                     "target states" if progress else None)
    held_features = load_or_extract(ckpt / "held_out_features.pt", model, texts.held_out, aux_layers,
                                    "held-out states" if progress else None)
    embed = torch.nn.Embedding.from_pretrained(model.get_input_embeddings().weight.detach().float(), freeze=True)
    target_head = model.get_output_embeddings().weight.detach().float()
    config = model.config
    del model

    state = load_state(ckpt / "state.pt")
    if state is not None:
        check_same_settings(state["settings"], settings, ckpt)
        vocab_ids = state["vocab_ids"]
    else:
        vocab_ids = choose_draft_vocab(train_features.labels, config.vocab_size, settings.draft_vocab)
    head = new_head(head_config(config, len(vocab_ids)), vocab_ids, target_head, settings.seed)
    t2d = torch.full((config.vocab_size,), -1, dtype=torch.int64)
    t2d[vocab_ids] = torch.arange(len(vocab_ids))
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    losses: list[float] = []
    step = 0
    if state is not None:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        step, losses = state["step"], list(state["losses"])

    train = Batches(train_texts, train_features, settings.seq_len)
    end = settings.steps if stop_after is None else min(settings.steps, step + stop_after)
    bar = tqdm(total=settings.steps, initial=step, desc="training head", unit="step") if progress else None
    head.train()
    lengths = [min(len(t.token_ids), settings.seq_len) for t in train_texts]
    autocast = settings.compute_dtype == "bfloat16"
    while step < end:
        aux, tokens, labels, answer = train.rows(grouped_batch(step, settings.batch_size, lengths, settings.seed))
        for group in optimizer.param_groups:
            group["lr"] = settings.lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = unrolled_logits(head, embed, aux.float(), tokens, settings.ttt_steps)
            value = ttt_loss(logits, labels, answer, t2d, settings.decay)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(float(value.detach()))
        step += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if step % settings.checkpoint_every == 0 or step == end:
            save_state(ckpt / "state.pt", settings=asdict(settings), vocab_ids=vocab_ids, head=head.state_dict(),
                       optimizer=optimizer.state_dict(), step=step, losses=losses, rng=torch.get_rng_state())
    if bar is not None:
        bar.close()
    head.eval()
    finished = step >= settings.steps
    if finished:
        held = Batches(texts.held_out, held_features, settings.seq_len)
        acceptance = held_out_acceptance(head, embed, held, settings.ttt_steps, settings.batch_size)
        coverage = float(torch.isin(torch.cat(held_features.labels), vocab_ids).float().mean())
        report = {"settings": asdict(settings), "aux_layer_ids": list(aux_layers), "losses": losses,
                  "num_train_texts": len(train_texts), "num_texts_made": len(texts.train),
                  "num_train_tokens": sum(len(t.token_ids) - t.prompt_len for t in train_texts),
                  "held_out_vocab_coverage": coverage, **acceptance}
        save_head(head, out, torch.bfloat16)  # as published heads are stored; the engine casts to its dtype
        tmp = out / f".head_report.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, out / "head_report.json")
    return HeadResult(out, step, losses, finished)


@torch.no_grad()
def held_out_acceptance(head: Eagle3Head, embed: torch.nn.Embedding, held: Batches, steps: int,
                        batch_size: int) -> dict:
    """Greedy acceptance per draft position on held-out texts: ``acceptance_per_position[j]`` is the
    share of places where drafts ``0..j-1`` were the target's choices in which draft ``j`` is too;
    ``mean_acceptance_length`` is 1 + the expected accepted drafts of ``steps`` (the bonus token counted)."""
    chained_hits = [0] * steps
    chained_tries = [0] * steps
    for lo in range(0, len(held), batch_size):
        aux, tokens, labels, answer = held.rows(list(range(lo, min(lo + batch_size, len(held)))))
        logits = unrolled_logits(head, embed, aux.float(), tokens, steps)
        alive = None
        for j, step_logits in enumerate(logits):
            hit, scored = step_hits(step_logits, labels, answer, head.d2t, j)
            alive = scored if alive is None else alive & scored
            chained_tries[j] += int(alive.sum())
            alive = alive & hit
            chained_hits[j] += int(alive.sum())
    per_position = [h / t if t else 0.0 for h, t in zip(chained_hits, chained_tries)]
    mean_length, survive = 1.0, 1.0
    for rate in per_position:
        survive *= rate
        mean_length += survive
    return {"acceptance_per_position": per_position, "mean_acceptance_length": mean_length,
            "held_out_places": chained_tries[0]}

