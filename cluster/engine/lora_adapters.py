"""Which LoRA adapters an engine holds: those of ``model.lora_modules``, loaded at start and kept,
and those of ``model.lora_dir``, loaded when a request first names one.

At most ``model.max_loras`` adapters are loaded at once. A request whose adapter is not loaded
makes room by unloading the least recently used adapter from ``lora_dir`` that no request in the
engine (waiting or running) holds; while every one is held, the request waits here, in arrival
order, and joins the scheduler once a holder finishes (as vLLM's scheduler holds back a request
whose adapter would exceed its ``max_loras``). Unloading an adapter drops its blocks' names from the
prefix cache, so an adapter loaded again (its folder may have changed) never reads the KV of
the one before.

Reading an adapter's folder (``resolve``, when a request is made) and stacking it onto the model
(``add`` and ``admit_waiting``, between steps) are apart, so an engine stepping in another
thread only changes the model between steps.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Iterable

from cluster.config import TandemConfig
from cluster.errors import ParamError
from cluster.kv.block_pool import BlockPool
from cluster.models.lora import LoRAAdapter, LoRAState, load_adapter
from cluster.shared.lora_dir import adapter_folder, no_adapter
from cluster.shared.request import Request


class LoRAAdapters:
    def __init__(self, config: TandemConfig, state: LoRAState | None, model, pool: BlockPool) -> None:
        self.state, self.model, self.pool = state, model, pool
        self.static = frozenset(config.model.lora_modules)
        self.lora_dir = config.model.lora_dir
        self.max_loras = config.model.max_loras
        self.max_rank = config.model.max_lora_rank
        # Requests whose adapter has no room yet, in arrival order, each with its adapter as read.
        self.waiting: list[tuple[Request, LoRAAdapter | None]] = []
        self.num_loads = self.num_unloads = 0
        self.load_seconds = 0.0  # reading and stacking the adapters loaded on demand, in all
        self._recent: OrderedDict[str, None] = OrderedDict()  # loaded from lora_dir, least recently used first
        self._read: dict[str, LoRAAdapter] = {}  # read by resolve, not stacked yet
        self._read_seconds: dict[str, float] = {}  # how long the latest read of each took

    @property
    def mean_load_seconds(self) -> float:
        """What loading an adapter from ``lora_dir`` has taken here on average (0: none yet)."""
        return self.load_seconds / self.num_loads if self.num_loads else 0.0

    @property
    def loaded(self) -> list[str]:
        return list(self.state.slots) if self.state is not None else []

    def resolve(self, name: str | None) -> None:
        """Check that ``name`` (None: the base model) can be served; reads its folder when it is
        an adapter of ``lora_dir`` not loaded. ParamError (NotFoundError: no such adapter) says why not."""
        if name is None or (self.state is not None and name in self.state.slots) or name in self._read:
            return
        if self.lora_dir is None:
            raise ParamError("model", f"no LoRA adapter {name!r} is served here (adapters: "
                                      f"{', '.join(self.loaded) or 'none'})")
        if len(self._read) >= self.max_loras:  # read for requests refused before they were added
            self._read.clear()
            self._read_seconds.clear()
        self._read[name] = self._load(name)

    def _load(self, name: str) -> LoRAAdapter:
        folder = adapter_folder(self.lora_dir, name)
        if folder is None:
            raise no_adapter(self.lora_dir, name)
        started = time.perf_counter()
        adapter = load_adapter(name, folder, self.model, self.max_rank)
        self._read_seconds[name] = time.perf_counter() - started
        return adapter

    def add(self, request: Request, live: Iterable[Request]) -> bool:
        """Whether ``request`` may join the scheduler now (its adapter loaded, unloading an idle one
        if there is no room); else it waits here. Raises LoRAError when its folder no longer loads."""
        name = request.lora_name
        if name is None or name in self.static:
            return True
        adapter = None if name in self.state.slots else (self._read.pop(name, None) or self._load(name))
        # Behind requests already waiting for room, an adapter to load waits too (arrival order).
        if (adapter is None or not self.waiting) and self._stack(name, adapter, live):
            return True
        self.waiting.append((request, adapter))
        return False

    def _stack(self, name: str, adapter: LoRAAdapter | None, live: Iterable[Request]) -> bool:
        if name in self.state.slots:
            self._recent.move_to_end(name)
            return True
        if len(self.state.slots) >= self.max_loras:
            held = {r.lora_name for r in live}
            idle = next((n for n in self._recent if n not in held), None)
            if idle is None:
                return False
            self._unload(idle)
        started = time.perf_counter()
        self.state.add(adapter)
        self.load_seconds += time.perf_counter() - started + self._read_seconds.pop(name, 0.0)
        self._recent[name] = None
        self.num_loads += 1
        return True

    def _unload(self, name: str) -> None:
        self.state.remove(name)
        del self._recent[name]
        key = ("lora", name)
        self.pool.forget(lambda block_hash: key in block_hash.extra_keys)
        self.num_unloads += 1

    def admit_waiting(self, live: list[Request]) -> list[Request]:
        """The waiting requests whose adapter is now loaded, in arrival order (``live``: the
        scheduler's requests; those returned join it)."""
        admitted, still = [], []
        for request, adapter in self.waiting:
            if self._stack(request.lora_name, adapter, live + admitted):
                admitted.append(request)
            else:
                still.append((request, adapter))
        self.waiting = still
        return admitted

    def drop(self, request_id: str) -> bool:
        """Forget a waiting request (aborted); whether it was waiting here."""
        before = len(self.waiting)
        self.waiting = [entry for entry in self.waiting if entry[0].request_id != request_id]
        return len(self.waiting) != before
