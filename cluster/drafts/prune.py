"""Prune a Llama-family target to a few of its decoder layers: the draft's starting point.

The student is a ``transformers`` ``LlamaForCausalLM`` (the training model; our paged
inference model cannot train) whose config is the target's with
``num_hidden_layers = len(layers)``. Its embedding (tied to the head) and final norm
start as the target's; layer ``i`` of the student is a copy of target layer
``layers[i]``. The embedding is the target's own tensor, frozen: the draft's own
weights are only its layers and its final norm (:func:`own_state_dict`).

Which layers survive is a :data:`LAYER_CHOICES` strategy; :func:`heldout_kl` measures
each before training so the choice is made by measurement.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from cluster.models.hf_folder import ModelSource, iter_weights
from cluster.models.loader import load_hf_config

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

    from cluster.drafts.distill_data import Rows

LAYER_CHOICES = ("first", "even", "first-last")
EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


def select_layers(num_layers: int, n: int, choice: str) -> list[int]:
    """Indices of the target layers a ``n``-layer draft keeps, ascending.

    ``first``: 0..n-1. ``even``: n evenly spaced, first and last included.
    ``first-last``: 0..n-2 and the last layer (the last layer shapes the output space).
    """
    if not 1 <= n <= num_layers:
        raise ValueError(f"--layers must be between 1 and the target's {num_layers} layers, got {n}")
    if choice not in LAYER_CHOICES:
        raise ValueError(f"unknown layer choice {choice!r}; allowed: {', '.join(LAYER_CHOICES)}")
    if choice == "first" or n == num_layers:
        return list(range(n))
    if choice == "first-last" or n == 1:
        return list(range(n - 1)) + [num_layers - 1] if n > 1 else [num_layers - 1]
    return sorted({round(i * (num_layers - 1) / (n - 1)) for i in range(n)})


def load_target(source: ModelSource) -> LlamaForCausalLM:
    """The target as a float32 ``LlamaForCausalLM`` in eval mode, weights from our loader."""
    # here, not at the top: transformers' model classes would add ~1.4 s to every tandem command
    from transformers import LlamaForCausalLM

    config = load_hf_config(source)
    if getattr(config, "model_type", None) != "llama":
        raise ValueError(f"draft distillation supports Llama-family targets; {source.path} is "
                         f"{getattr(config, 'model_type', '?')!r}")
    config.use_cache = False
    model = LlamaForCausalLM(config).to(torch.float32)
    state = {name: tensor.to(torch.float32) for name, tensor in iter_weights(source)}
    if config.tie_word_embeddings:
        state.pop(HEAD, None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == HEAD and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{source.path}: weights do not match the config (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    model.tie_weights()
    model.eval().requires_grad_(False)
    return model


def prune(target: LlamaForCausalLM, layers: list[int]) -> LlamaForCausalLM:
    """A student holding copies of ``layers`` and the target's (shared, frozen) embedding.

    Invariant: only the student's layers and final norm require grad.
    """
    # here, not at the top: transformers' model classes would add ~1.4 s to every tandem command
    from transformers import LlamaForCausalLM

    if not target.config.tie_word_embeddings:
        raise ValueError("draft distillation needs a target with tied embeddings (the head is shared)")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    for key in ("layer_types",):  # per-layer lists must shrink with the layers
        value = getattr(config, key, None)
        if isinstance(value, list):
            setattr(config, key, [value[i] for i in layers])
    student = LlamaForCausalLM(config).to(torch.float32)
    student.model.embed_tokens.weight = target.model.embed_tokens.weight  # shared, frozen
    student.tie_weights()
    with torch.no_grad():
        student.model.norm.load_state_dict(target.model.norm.state_dict())
        for i, j in enumerate(layers):
            student.model.layers[i].load_state_dict(target.model.layers[j].state_dict())
    student.requires_grad_(False)
    student.model.layers.requires_grad_(True)
    student.model.norm.requires_grad_(True)
    return student


def own_state_dict(student: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The draft's own tensors (layers + final norm), HF names, detached."""
    return {name: p.detach() for name, p in student.named_parameters() if name not in (EMBEDDING, HEAD)}


def kl_to_target(target: LlamaForCausalLM, student: LlamaForCausalLM, token_ids: torch.Tensor,
                 loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of KL(target || student) on full next-token distributions.

    ``token_ids``/``loss_mask``: [batch, seq_len]. Differentiable in the student.
    """
    with torch.no_grad():
        target_hidden = target.model(input_ids=token_ids).last_hidden_state[loss_mask]
    return kl_from_target_hidden(target, target_hidden, student, token_ids, loss_mask)


def kl_from_target_hidden(target: LlamaForCausalLM, target_hidden: torch.Tensor, student: LlamaForCausalLM,
                          token_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """:func:`kl_to_target` given the target's final (normed) hidden states at the masked
    positions, ``target_hidden`` [num_tokens, hidden_size]: only the target's head runs."""
    with torch.no_grad():
        target_logprobs = torch.log_softmax(target.lm_head(target_hidden), dim=-1)  # [num_tokens, vocab_size]
    student_logprobs = torch.log_softmax(_masked_logits(student, token_ids, loss_mask), dim=-1)
    target_probs = target_logprobs.exp()
    per_token = (target_probs * (target_logprobs - student_logprobs)).sum(-1)  # [num_tokens]
    return per_token.mean()


@torch.no_grad()
def target_hidden_states(target: LlamaForCausalLM, rows: Rows, batch_size: int) -> torch.Tensor:
    """The target's final hidden states of every row, [num_rows, seq_len, hidden_size].

    The target is frozen, so these are computed once (in fixed batches: the result does
    not depend on the training order) and the training steps run only its head."""
    out = [target.model(input_ids=rows.token_ids[i : i + batch_size]).last_hidden_state
           for i in range(0, len(rows), batch_size)]
    return torch.cat(out) if out else torch.empty(0, rows.token_ids.shape[1], target.config.hidden_size)


@torch.no_grad()
def heldout_kl(target: LlamaForCausalLM, student: LlamaForCausalLM, rows: Rows, batch_size: int) -> float:
    """Token-weighted mean KL(target || student) over ``rows`` (a draft's held-out score)."""
    total = weight = 0.0
    for start in range(0, len(rows), batch_size):
        batch = rows.batch(list(range(start, min(start + batch_size, len(rows)))))
        if batch.num_tokens == 0:
            continue
        total += float(kl_to_target(target, student, batch.token_ids, batch.loss_mask)) * batch.num_tokens
        weight += batch.num_tokens
    return total / weight if weight else float("nan")


def _masked_logits(model: LlamaForCausalLM, token_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Logits at the masked positions only (the head is the costliest matmul). [num_tokens, vocab_size]"""
    hidden = model.model(input_ids=token_ids).last_hidden_state  # [batch, seq_len, hidden]
    return model.lm_head(hidden[loss_mask])
