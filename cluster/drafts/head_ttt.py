"""The head's training forward: ``steps`` draft steps unrolled over whole texts ("training-time test").

Index ``t`` of a text of tokens ``x`` and target features ``F`` is a place where the target has
verified the text up to ``x[t + 1]``. Step 0 there reads ``(F[t], x[t + 1])`` at position ``t``;
step ``j`` reads the head's own step ``j - 1`` output and ``x[t + j + 1]`` at position ``t + j``,
and is scored on the target's greedy choice after ``x[t + j + 1]``. Its attention sees what it
would see while drafting: the step-0 entries of indices ``<= t`` (the head's cache of verified
positions) and its own earlier steps at index ``t`` (the drafts before it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cluster.models.eagle3 import Eagle3Head


def unrolled_logits(head: Eagle3Head, embed: torch.nn.Embedding, aux: torch.Tensor, tokens: torch.Tensor,
                    steps: int) -> list[torch.Tensor]:
    """aux [B, T, A], tokens [B, T] (right-padded) -> per step, logits [B, T, draft_vocab]
    (float32); step ``j`` at index ``t`` predicts the token after ``x[t + j + 1]``."""
    batch, length = tokens.shape
    cfg = head.config
    layer = head.midlayer
    hidden = head.fuse(aux)
    index = torch.arange(length, device=tokens.device)
    causal = index[None, :] <= index[:, None]  # [T (query), T (key)]
    scale = cfg.head_dim ** -0.5
    group = cfg.num_heads // cfg.num_kv_heads
    keys, values, logits = [], [], []
    for j in range(steps):
        shifted = torch.roll(tokens, -(j + 1), dims=1)  # x[t + j + 1]; the wrapped tail is never scored
        x = layer.attention_input(embed(shifted), hidden).reshape(batch * length, -1)
        positions = (index + j).clamp(max=cfg.max_position_embeddings - 1).repeat(batch)
        q, k, v = layer.self_attn.rotated_qkv(x, head.rotary(positions, hidden.dtype))
        q = q.view(batch, length, cfg.num_heads, cfg.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(batch, length, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2).repeat_interleave(group, 1)
        v = v.view(batch, length, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2).repeat_interleave(group, 1)
        keys.append(k)
        values.append(v)
        verified = (q @ keys[0].transpose(-1, -2)) * scale  # [B, H, T, T]
        verified = verified.masked_fill(~causal, float("-inf"))
        own = [((q * keys[i]).sum(-1) * scale).unsqueeze(-1) for i in range(1, j + 1)]  # [B, H, T, 1] each
        weights = torch.softmax(torch.cat([verified, *own], dim=-1), dim=-1)
        out = weights[..., :length] @ values[0]
        for i in range(1, j + 1):
            out = out + weights[..., length + i - 1 : length + i] * values[i]
        attn = out.transpose(1, 2).reshape(batch, length, -1)
        hidden = layer.finish(attn, hidden)
        logits.append(head.logits(hidden))
    return logits


def step_targets(labels: torch.Tensor, answer_mask: torch.Tensor, t2d: torch.Tensor, step: int) -> torch.Tensor:
    """labels [B, T] (target ids; ``labels[u]`` follows ``x[u]``), answer_mask [B, T] (``u`` is scored) ->
    draft-vocabulary ids of step ``step``'s targets, -100 where not scored or out of the draft vocabulary."""
    shift = step + 1
    length = labels.shape[1]
    target = torch.full_like(labels, -100)
    mask = torch.zeros_like(answer_mask)
    if shift < length:
        target[:, : length - shift] = t2d[labels[:, shift:]]
        mask[:, : length - shift] = answer_mask[:, shift:]
    return target.masked_fill(~mask | (target < 0), -100)


def step_hits(logits: torch.Tensor, labels: torch.Tensor, answer_mask: torch.Tensor, d2t: torch.Tensor,
              step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hit [B, T] bool: step ``step``'s greedy draft is the target's choice; scored [B, T] bool)."""
    shift = step + 1
    length = labels.shape[1]
    drafted = logits.argmax(-1)
    drafted = drafted + d2t[drafted]
    hit = torch.zeros_like(answer_mask)
    scored = torch.zeros_like(answer_mask)
    if shift < length:
        hit[:, : length - shift] = drafted[:, : length - shift] == labels[:, shift:]
        scored[:, : length - shift] = answer_mask[:, shift:]
    return hit & scored, scored


def loss(logits: list[torch.Tensor], labels: torch.Tensor, answer_mask: torch.Tensor, t2d: torch.Tensor,
         decay: float) -> torch.Tensor:
    """Cross-entropy of every step against the target's choices, step ``j`` weighted ``decay ** j``."""
    total = logits[0].new_zeros(())
    for j, step_logits in enumerate(logits):
        target = step_targets(labels, answer_mask, t2d, j)
        if (target >= 0).any():
            total = total + decay**j * F.cross_entropy(step_logits.flatten(0, 1), target.flatten(), ignore_index=-100)
    return total
