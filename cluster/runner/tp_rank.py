"""A worker rank of a tensor-parallel engine (ranks 1..tp-1; the driver is rank 0).

:func:`run_worker` is what a launcher (:mod:`cluster.runner.tp_launcher`, or Ray actors in
``deployments/tp_ranks.py``) runs in each rank's process: join the group, load this rank's
shard, allocate its part of the KV cache (the driver's block count: the minimum over the
ranks), then run the driver's forward pass on every :class:`StepMessage` it broadcasts
until it sends ``None``. The driver's side is :mod:`cluster.runner.tp_executor`.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from cluster.config import TandemConfig
from cluster.parallel.group import StoreAddress, TPGroup, connect_store, init_group
from cluster.runner.attention_choice import choose_attention
from cluster.runner.input_batch import SeqChunk
from cluster.runner.model_runner import ModelRunner
from cluster.runner.worker import load_model, num_kv_blocks, use_step_threads

logger = logging.getLogger(__name__)


class StepMessage(NamedTuple):
    """What every rank needs to run the driver's forward pass."""

    chunks: list[SeqChunk]
    block_tables: list[list[int]]


def gloo_host(address: StoreAddress) -> str | None:
    """Ranks that meet on loopback bind gloo there too (a container's host name may not
    resolve to a reachable address); others let gloo resolve their own host name."""
    return address.host if address.host.startswith("127.") or address.host == "localhost" else None


def run_worker(config: TandemConfig, rank: int, address: StoreAddress, device: str) -> None:
    """A worker rank: join the group, load this rank's shard, then follow the driver until
    it sends ``None`` or goes away."""
    if config.device.num_threads:
        torch.set_num_threads(config.device.num_threads)
    timeout_s = config.parallel.collective_timeout_s
    store = connect_store(address, timeout_s)
    store.set(f"joined/{rank}", "1")
    try:
        group = init_group(store, rank, config.parallel.tensor_parallel_size, torch.device(device), timeout_s,
                           gloo_host(address))
        loaded = load_model(config, group.device, group)
    except Exception as err:
        store.set(f"failed/{rank}", f"{type(err).__name__}: {err}")
        raise
    store.set(f"ready/{rank}", "1")
    num_blocks = group.min_int(num_kv_blocks(config, loaded.spec, group.device))
    runner = ModelRunner(loaded.model, num_blocks, loaded.spec, group.device,
                         attention=choose_attention(config, group.device, loaded.max_model_len, True))
    use_step_threads(config, group.device)
    _follow(group, runner)


def _follow(group: TPGroup, runner: ModelRunner) -> None:
    while True:
        try:
            message = group.broadcast_object()
        except Exception as err:  # the driver is gone: nothing left to serve
            logger.warning("tensor-parallel rank %d lost the driver: %s", group.rank, err)
            return
        if message is None:
            return
        runner.forward_logits(message.chunks, message.block_tables)
