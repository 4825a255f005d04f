"""A step's drafts as a proposer hands them to the grammars and the runner."""

from __future__ import annotations

from typing import NamedTuple

import torch


class DraftProposal(NamedTuple):
    token_ids: dict[str, list[int]]  # request id -> draft tokens
    probs: dict[str, torch.Tensor] | None  # request id -> [num_drafts, vocab_size] float32
