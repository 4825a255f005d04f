"""The process group of one tensor-parallel engine and the collectives its layers use.

Every engine makes its own group: the driver opens a ``TCPStore`` on a port the OS
picks (port 0), so several engines can share a host and no port is written down
anywhere. Two groups share that store: the *device* group (NCCL on CUDA, gloo on the
CPU) carries activations, and a gloo *control* group on the CPU carries the small
per-step batch description and the shutdown message. Every collective has the
engine's ``collective_timeout_s``, so a dead peer fails a step instead of hanging it.

A :class:`TPGroup` is passed to the layers that need it; nothing here is global.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# The prefixes keep the two groups' keys apart in the shared store.
_DEVICE_PREFIX = "device"
_CONTROL_PREFIX = "control"
# Workers wait on the control group for the next step however long the engine idles;
# a driver that dies closes its sockets, which ends that wait with an error.
_IDLE_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class StoreAddress:
    """Where rank 0's TCPStore listens; picked at run time."""

    host: str
    port: int


@dataclass(frozen=True)
class TPGroup:
    """This rank's view of its tensor-parallel group.

    Invariant: ``0 <= rank < world_size``; rank 0 is the driver (it schedules and samples).
    """

    rank: int
    world_size: int
    device: torch.device
    device_group: dist.ProcessGroup
    control_group: dist.ProcessGroup
    store: dist.Store

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # any shape, summed over ranks in place
        self.device_group.allreduce([x]).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` ([..., n]) along the last dim, on the driver only.

        Returns [..., world_size * n] on rank 0 and None elsewhere.
        """
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if not self.is_driver:
            self.device_group.gather([], [x], opts).wait()
            return None
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.device_group.gather([parts], [x], opts).wait()
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: object = None) -> object:
        """Send a picklable ``obj`` from the driver to every rank over the CPU control group;
        every rank returns it. Workers block here between steps, without a timeout."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if self.is_driver:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.control_group.broadcast([size], opts).wait()
        if not self.is_driver:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.control_group.broadcast([payload], opts).wait()
        return obj if self.is_driver else pickle.loads(payload.numpy().tobytes())

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over all ranks (e.g. KV blocks that fit on every device)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.control_group.allreduce([t], opts).wait()
        return int(t.item())


def open_store(host: str = "127.0.0.1") -> tuple[dist.TCPStore, StoreAddress]:
    """The driver's store on a free port the OS chooses; workers connect to the address."""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, use_libuv=False)
    return store, StoreAddress(host, store.port)


def connect_store(address: StoreAddress, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(address.host, address.port, is_master=False, timeout=timedelta(seconds=timeout_s),
                         use_libuv=False)


def init_group(
    store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float,
    gloo_host: str | None = None,
) -> TPGroup:
    """Join both groups of this engine (every rank calls it with the same ``world_size``).

    The groups are standalone (no default group is set), so one process may drive
    several engines. ``gloo_host``: the address gloo binds to (loopback for ranks on
    one host); None lets gloo resolve this host's name.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        device_group = dist.ProcessGroupNCCL(dist.PrefixStore(_DEVICE_PREFIX, store), rank, world_size, opts)
    else:
        device_group = _gloo(dist.PrefixStore(_DEVICE_PREFIX, store), rank, world_size,
                             timedelta(seconds=timeout_s), gloo_host)
    control_group = _gloo(dist.PrefixStore(_CONTROL_PREFIX, store), rank, world_size, _IDLE_TIMEOUT, gloo_host)
    return TPGroup(rank, world_size, device, device_group, control_group, store)


def _gloo(store: dist.Store, rank: int, world_size: int, timeout: timedelta, host: str | None) -> dist.ProcessGroup:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    gloo = dist.ProcessGroupGloo
    opts._devices = [gloo.create_device(hostname=host) if host else gloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)
