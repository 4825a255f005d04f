"""A step's one read of its results: token ids and, where asked for, logprobs, in one copy to the host.

Every ``.tolist()`` of a CUDA tensor waits for the stream. The step's tokens and the logprobs of
the tokens it emits (ids, values, ranks) are packed into one flat int64 tensor (the float32
values as their bits, widened) and copied once; unpacking is exact, so the values read are the
float32 values computed.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from cluster.runner.sampler import LogprobsTensors
from cluster.shared.sampled import PositionLogprobs


class StepRead(NamedTuple):
    tokens: list  # the token tensor's host copy, nested as its shape
    # per row of the logprobs tensors: (token ids, logprobs, rank of the first id), at their full width
    logprobs: list[PositionLogprobs] | None


def read_step(
    tokens: torch.Tensor,  # int64, any shape
    logprobs: LogprobsTensors | None,  # [num_rows, width] each (sampled_rank [num_rows])
) -> StepRead:
    """``tokens`` and ``logprobs`` on the host, read in one copy."""
    parts = [tokens.reshape(-1).long()]
    if logprobs is not None:
        values = logprobs.logprobs.float().contiguous().view(torch.int32)  # the float32 bits
        parts += [logprobs.token_ids.reshape(-1).long(), logprobs.sampled_rank.reshape(-1).long(),
                  values.reshape(-1).long()]
    host = torch.cat(parts).cpu().numpy()  # the one wait
    num_tokens = tokens.numel()
    token_list = host[:num_tokens].reshape(tuple(tokens.shape)).tolist()
    if logprobs is None:
        return StepRead(token_list, None)
    num_rows, width = logprobs.token_ids.shape
    ids_end = num_tokens + num_rows * width
    ids = host[num_tokens:ids_end].reshape(num_rows, width).tolist()
    ranks = host[ids_end : ids_end + num_rows].tolist()
    values = host[ids_end + num_rows :].astype(np.int32).view(np.float32).reshape(num_rows, width).tolist()
    return StepRead(token_list, list(zip(ids, values, ranks)))


def first_logprobs(entry: PositionLogprobs, num_logprobs: int) -> PositionLogprobs:
    """A row read at the step's widest ``num_logprobs``, cut to a request's own: its token, then its top-n."""
    ids, values, rank = entry
    return ids[: num_logprobs + 1], values[: num_logprobs + 1], rank
