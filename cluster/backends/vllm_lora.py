"""The LoRA adapters of a vLLM group: ``model.lora_modules``, and the folders of ``model.lora_dir``,
each handed to vLLM the first time a request names it.

An adapter from ``lora_dir`` gets the next ``LoRARequest`` id and is loaded through vLLM's
``add_lora`` before its first request, so an adapter vLLM cannot load is that request's 400 (as
vLLM's server answers for its own LoRA resolvers), not a failed step; vLLM then keeps at most
``max_cpu_loras`` of them (``model.max_loras``), least recently used out first, and reloads an
adapter it dropped when a request names it again. ``loaded`` follows that cache as far as this
group's requests tell it (vLLM's own list is async, the router reads a sync snapshot): the
``max_loras`` adapters named most recently; with ``mean_load_seconds`` (what ``add_lora`` took),
the router prefers the replicas that hold a request's adapter, as for native groups.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict

from cluster.config import TandemConfig
from cluster.hosting.backend import input_error
from cluster.hosting.protocol import ErrorInfo
from cluster.shared.lora_dir import adapter_folder, no_adapter


class VllmAdapters:
    def __init__(self, config: TandemConfig, engine) -> None:
        from vllm.lora.request import LoRARequest  # here, not at the top: vLLM is optional

        self._make = LoRARequest
        self.engine = engine
        self.lora_dir = config.model.lora_dir
        self.max_loras = config.model.max_loras
        self.num_loads = 0
        self.load_seconds = 0.0  # add_lora of the adapters from lora_dir, in all
        self._recent: OrderedDict[str, None] = OrderedDict()  # least recently named first
        self._ids = itertools.count(1)
        self.requests = {name: LoRARequest(name, next(self._ids), folder)
                         for name, folder in config.model.lora_modules.items()}

    def check(self, name: str | None) -> ErrorInfo | None:
        """Why ``name`` cannot be served here (None: it can, or it is the base model)."""
        if name is None or name in self.requests:
            return None
        if self.lora_dir is None:
            return ErrorInfo(400, f"no LoRA adapter {name!r} is served here (adapters: "
                                  f"{', '.join(self.requests) or 'none'})", param="model")
        if adapter_folder(self.lora_dir, name) is None:
            return input_error(no_adapter(self.lora_dir, name))
        return None

    async def request_for(self, name: str | None):
        """``name``'s LoRARequest (None for the base model), handed to vLLM first when it comes from
        ``lora_dir``; an ErrorInfo when vLLM cannot load it. ``check`` it first."""
        if name is None:
            return None
        if name not in self.requests:
            request = self.requests[name] = self._make(name, next(self._ids),
                                                       str(adapter_folder(self.lora_dir, name)))
            started = time.perf_counter()
            try:
                await self.engine.add_lora(request)
            except Exception as err:  # vLLM's message says what is wrong with the folder
                del self.requests[name]
                return ErrorInfo(400, f"LoRA adapter {name!r} cannot be loaded: {err}", param="model")
            self.num_loads += 1
            self.load_seconds += time.perf_counter() - started
        self._recent[name] = None
        self._recent.move_to_end(name)
        while len(self._recent) > self.max_loras:
            self._recent.popitem(last=False)
        return self.requests[name]

    @property
    def loaded(self) -> frozenset[str]:
        """The adapters vLLM holds, as far as this group's requests tell (see the module's docstring)."""
        return frozenset(self._recent)

    @property
    def mean_load_seconds(self) -> float:
        return self.load_seconds / self.num_loads if self.num_loads else 0.0
