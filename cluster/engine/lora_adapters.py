"""Which LoRA adapters an engine holds: those of ``model.lora_modules``, loaded at start and kept,
and those of ``model.lora_dir``, loaded when a request first names one.

At most ``model.max_loras`` adapters are loaded at once. A request whose adapter is not loaded
makes room by unloading the least recently used adapter from ``lora_dir`` that no request in the
engine (waiting or running) holds; while every one is held, the request waits here, in arrival
order, and joins the scheduler once a holder finishes (as vLLM's scheduler holds back a request
whose adapter would exceed its ``max_loras``). Unloading an adapter drops its blocks' names from the
prefix cache, so an adapter loaded again (its folder may have changed) never reads the KV of
the one before.

Reading an adapter's folder and stacking it onto the model (``add`` and ``admit_waiting``,
between steps) are apart, so an engine stepping in another thread only changes the model between
steps. The read happens when a request is made (``resolve``), or, for a loop that must keep
stepping meanwhile (the engine core), in a thread beside it: ``read_later`` parks the request's
item until ``reads_done`` hands it back with the adapter read (or why it could not be).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, NamedTuple

from cluster.config import TandemConfig
from cluster.errors import ParamError
from cluster.kv.block_pool import BlockPool
from cluster.models.lora import LoRAAdapter, LoRAState, load_adapter
from cluster.shared.lora_dir import adapter_folder, no_adapter
from cluster.shared.request import Request


class ReadAdapter(NamedTuple):
    adapter: LoRAAdapter
    seconds: float  # how long reading its folder took


class LoRAAdapters:
    def __init__(self, config: TandemConfig, state: LoRAState | None, model, pool: BlockPool) -> None:
        self.state, self.model, self.pool = state, model, pool
        self.static = frozenset(config.model.lora_modules)
        self.lora_dir = config.model.lora_dir
        self.max_loras = config.model.max_loras
        self.max_rank = config.model.max_lora_rank
        # Requests whose adapter has no room yet, in arrival order, each with its adapter as read.
        self.waiting: list[tuple[Request, ReadAdapter | None]] = []
        self.num_loads = self.num_unloads = 0
        self.load_seconds = 0.0  # reading and stacking the adapters loaded on demand, in all
        self._recent: OrderedDict[str, None] = OrderedDict()  # loaded from lora_dir, least recently used first
        self._read: dict[str, ReadAdapter] = {}  # read by resolve, not stacked yet
        self._reader: ThreadPoolExecutor | None = None  # started by the first read_later
        # Reads under way beside the loop: per adapter, the read and the items parked for it.
        self._reading: dict[str, tuple[Future, list[tuple[str, Any]]]] = {}

    @property
    def mean_load_seconds(self) -> float:
        """What loading an adapter from ``lora_dir`` has taken here on average (0: none yet)."""
        return self.load_seconds / self.num_loads if self.num_loads else 0.0

    @property
    def loaded(self) -> list[str]:
        return list(self.state.slots) if self.state is not None else []

    @property
    def num_reading(self) -> int:
        """Requests parked by ``read_later`` whose adapter is still being read."""
        return sum(len(items) for _, items in self._reading.values())

    def needs_read(self, name: str | None) -> bool:
        """Whether serving ``name`` (None: the base model) takes reading its folder first (an
        adapter of ``lora_dir`` neither loaded nor read). ParamError (NotFoundError: no such
        adapter) says why it cannot be served."""
        if name is None or (self.state is not None and name in self.state.slots) or name in self._read:
            return False
        if self.lora_dir is None:
            raise ParamError("model", f"no LoRA adapter {name!r} is served here (adapters: "
                                      f"{', '.join(self.loaded) or 'none'})")
        if adapter_folder(self.lora_dir, name) is None:
            raise no_adapter(self.lora_dir, name)
        return True

    def read(self, name: str) -> ReadAdapter:
        """Read ``name``'s folder in ``lora_dir``; touches nothing here, so any thread may call it.
        LoRAError (NotFoundError: the folder is gone) names what cannot be served."""
        folder = adapter_folder(self.lora_dir, name)
        if folder is None:
            raise no_adapter(self.lora_dir, name)
        started = time.perf_counter()
        adapter = load_adapter(name, folder, self.model, self.max_rank)
        return ReadAdapter(adapter, time.perf_counter() - started)

    def keep(self, read: ReadAdapter) -> None:
        """Hold an adapter ``read`` for the requests about to name it (``add`` stacks it)."""
        if len(self._read) >= self.max_loras:  # read for requests refused before they were added
            self._read.clear()
        self._read[read.adapter.name] = read

    def resolve(self, name: str | None) -> None:
        """Check that ``name`` can be served, reading its folder here if it must be read."""
        if self.needs_read(name):
            self.keep(self.read(name))

    def read_later(self, name: str, request_id: str, item: Any) -> None:
        """Read ``name``'s folder in a thread beside the caller's loop; ``item`` (the caller's
        request) comes back from ``reads_done`` once it is read. One read serves every item
        parked for the same adapter meanwhile."""
        if name not in self._reading:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-lora-read")
            self._reading[name] = (self._reader.submit(self.read, name), [])
        self._reading[name][1].append((request_id, item))

    def reads_done(self) -> list[tuple[Any, Exception | None]]:
        """The items whose adapter's read has ended, each with None when the adapter is kept
        for it (``resolve`` then finds it read) or the error that says why it cannot be served."""
        done = []
        for name in [n for n, (future, _) in self._reading.items() if future.done()]:
            future, items = self._reading.pop(name)
            error = future.exception()
            if error is None:
                self.keep(future.result())
            done.extend((item, error) for _, item in items)
        return done

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)

    def add(self, request: Request, live: Iterable[Request]) -> bool:
        """Whether ``request`` may join the scheduler now (its adapter loaded, unloading an idle one
        if there is no room); else it waits here. Raises LoRAError when its folder no longer loads."""
        name = request.lora_name
        if name is None or name in self.static:
            return True
        read = None
        if name not in self.state.slots:
            read = self._read.pop(name, None) or self.read(name)
        # Behind requests already waiting for room, an adapter to load waits too (arrival order).
        if (read is None or not self.waiting) and self._stack(name, read, live):
            return True
        self.waiting.append((request, read))
        return False

    def _stack(self, name: str, read: ReadAdapter | None, live: Iterable[Request]) -> bool:
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
        self.state.add(read.adapter)
        self.load_seconds += time.perf_counter() - started + read.seconds
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
        for request, read in self.waiting:
            if self._stack(request.lora_name, read, live + admitted):
                admitted.append(request)
            else:
                still.append((request, read))
        self.waiting = still
        return admitted

    def drop(self, request_id: str) -> bool:
        """Forget a request waiting here or parked for a read (aborted); whether it was."""
        before = len(self.waiting) + self.num_reading
        self.waiting = [entry for entry in self.waiting if entry[0].request_id != request_id]
        for _, items in self._reading.values():
            items[:] = [entry for entry in items if entry[0] != request_id]
        return len(self.waiting) + self.num_reading != before
