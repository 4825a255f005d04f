"""Starting the worker ranks of a tensor-parallel engine.

A launcher starts ranks 1..tp-1, each running :func:`cluster.runner.tp_rank.run_worker`,
and hands back a :class:`RankProcess` per rank that the driver polls before every step.
Outside Ray (the offline ``LLM``, tests) :class:`SpawnLauncher` starts local processes
with the ``spawn`` context; inside a Ray Serve replica, ``deployments/tp_ranks.py``
starts one Ray actor per rank in the replica's placement group. ``cluster`` never
imports ``ray``: the Ray launcher lives in ``deployments``.
"""

from __future__ import annotations

import multiprocessing
from typing import Protocol

from cluster.config import TandemConfig
from cluster.parallel.group import StoreAddress
from cluster.runner.tp_rank import run_worker


class RankProcess(Protocol):
    """A started worker rank, as the driver sees it."""

    def is_alive(self) -> bool: ...

    def exit_reason(self) -> str:
        """Why the rank stopped, for the error message (call once ``is_alive`` is False)."""
        ...

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the rank to stop by itself."""
        ...

    def terminate(self) -> None: ...


class RankLauncher(Protocol):
    store_host: str  # an address of the driver's host that every rank can reach
    isolates_devices: bool  # True: each rank sees only its own GPU, as cuda:0 (Ray sets CUDA_VISIBLE_DEVICES)

    def launch(self, config: TandemConfig, rank: int, address: StoreAddress, device: str) -> RankProcess: ...


class SpawnedRank:
    def __init__(self, process: multiprocessing.Process) -> None:
        self.process = process

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def exit_reason(self) -> str:
        return f"process {self.process.pid} exited with code {self.process.exitcode}"

    def join(self, timeout_s: float) -> None:
        self.process.join(timeout_s)

    def terminate(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)


class SpawnLauncher:
    """Ranks as local daemon processes (``spawn``: no state of the driver is forked)."""

    store_host = "127.0.0.1"
    isolates_devices = False

    def launch(self, config: TandemConfig, rank: int, address: StoreAddress, device: str) -> SpawnedRank:
        context = multiprocessing.get_context("spawn")
        process = context.Process(target=run_worker, args=(config, rank, address, device), daemon=True,
                                  name=f"tandem-tp-rank{rank}")
        process.start()
        return SpawnedRank(process)
