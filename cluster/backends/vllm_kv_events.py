"""A vLLM replica's cached prefixes, named as the router names them, from vLLM's KV events.

vLLM publishes its prefix cache's changes (``kv_events_config``: ``BlockStored`` with each new
block's tokens and its parent, ``BlockRemoved``, ``AllBlocksCleared``), the feed KV-aware routers
such as llm-d's consume. vLLM hashes blocks its own way, so :class:`PrefixIndex` names every
stored block again with Tandem's chained hash (``cluster/kv/prefix_cache.py``, the group's seed
and block size, what the ingress computes for a prompt: ``cluster/routing/prefix_hashes.py``)
and answers, as the native engine's block manager does, the names of the cached blocks
reachable from a prompt's first block within a depth. vLLM may keep larger blocks than the
group's (on the CPU it takes 128 tokens): a vLLM block of a multiple of the group's size carries
the names of each of its parts, in order. A block whose parent is gone is
unreachable and left out; blocks whose vLLM keys carry more than a LoRA adapter's name (a cache
salt, images) are not named, so such prompts find no affinity: nothing breaks.

:class:`KvEventSubscriber` reads the events from vLLM's ZMQ publisher in a thread of the
replica (it imports vLLM's event types and ZMQ, both in vLLM's environment).
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections import defaultdict

from cluster.config import TandemConfig
from cluster.kv.prefix_cache import ROOT_HASH, engine_hash_seed, xxh3_block_hash
from cluster.shared.request import cache_extra_keys

logger = logging.getLogger(__name__)


class PrefixIndex:
    def __init__(self, block_size: int, hash_seed: int) -> None:
        self.block_size = block_size
        self.hash_seed = hash_seed
        self._names: dict[object, list[int]] = {}  # vLLM's block hash -> Tandem's names of its parts
        self._children: dict[object | None, set] = defaultdict(set)  # vLLM parent (None: a first block)
        self._lock = threading.Lock()
        self.skipped = 0  # stored blocks left unnamed (unknown parent, other block size, extra keys)

    def apply(self, event) -> None:
        """One of vLLM's KV cache events, read by its class name and fields."""
        kind = type(event).__name__
        with self._lock:
            if kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                for block in event.block_hashes:
                    self._names.pop(block, None)
                    self._children.pop(block, None)
            elif kind == "AllBlocksCleared":
                self._names.clear()
                self._children.clear()

    def _stored(self, event) -> None:
        parent = event.parent_block_hash
        size = int(event.block_size)
        if size % self.block_size or (parent is not None and parent not in self._names):
            self.skipped += len(event.block_hashes)
            return
        lora = getattr(event, "lora_name", None)
        keys = getattr(event, "extra_keys", None) or []
        if any(k is not None and tuple(k) != (lora,) for k in keys):
            self.skipped += len(event.block_hashes)
            return
        extra = cache_extra_keys(None, lora)
        name = ROOT_HASH if parent is None else self._names[parent][-1]
        tokens = list(event.token_ids)
        for i, block in enumerate(event.block_hashes):
            if len(tokens) < (i + 1) * size:
                break
            names = []
            for start in range(i * size, (i + 1) * size, self.block_size):
                name = xxh3_block_hash(self.hash_seed, name, tuple(tokens[start: start + self.block_size]), extra)
                names.append(name)
            self._names[block] = names
            self._children[parent].add(block)
            parent = block

    def cached_prefix_hashes(self, max_depth: int) -> frozenset[int]:
        """Tandem's names of the cached blocks at depth ``< max_depth`` reachable from a first
        block (``BlockManager.cached_prefix_hashes``' answer for the native engine)."""
        found: set[int] = set()
        with self._lock:
            level, depth = [b for b in self._children.get(None, ()) if b in self._names], 0
            while level and depth < max_depth:
                parts = 0
                for block in level:
                    names = self._names[block][:max_depth - depth]
                    found.update(names)
                    parts = max(parts, len(names))
                depth += parts
                level = [c for b in level for c in self._children.get(b, ()) if c in self._names]
        return frozenset(found)


def kv_events_setup(config: TandemConfig, engine_args: dict) -> tuple[PrefixIndex | None, str]:
    """With prefix caching on: vLLM's ``kv_events_config`` (added to ``engine_args`` unless they
    name one: ZMQ on an ipc socket of this replica's own), the index the events go to and the
    endpoint to read them from; (None, "") where vLLM publishes none."""
    if not config.cache.enable_prefix_caching:
        return None, ""
    own = engine_args.get("kv_events_config")
    if own is None:
        folder = tempfile.mkdtemp(prefix="tandem-vllm-kv-")
        own = engine_args["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                                 "endpoint": f"ipc://{folder}/events", "topic": ""}
    if not own.get("enable_kv_cache_events") or own.get("publisher") != "zmq":
        return None, ""
    endpoint = str(own.get("endpoint", "tcp://*:5557")).replace("*", "127.0.0.1")
    seed = engine_hash_seed(config.model.model, config.model.dtype, config.model.seed)
    return PrefixIndex(config.cache.block_size, seed), endpoint


def with_kv_events_config(engine_args: dict) -> dict:
    """``engine_args`` with a ``kv_events_config`` given as a dict made vLLM's ``KVEventsConfig``."""
    if not isinstance(engine_args.get("kv_events_config"), dict):
        return engine_args
    from vllm.config import KVEventsConfig  # vLLM's environment

    return {**engine_args, "kv_events_config": KVEventsConfig(**engine_args["kv_events_config"])}


class KvEventSubscriber:
    """Reads vLLM's KV event batches from its ZMQ publisher at ``endpoint`` into ``index``."""

    def __init__(self, endpoint: str, index: PrefixIndex) -> None:
        import zmq  # vLLM's dependency, in its environment
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        self.index = index
        self._decoder = Decoder(type=KVEventBatch)
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.RCVTIMEO, 500)
        self._socket.connect(endpoint)
        self._stop = threading.Event()
        self.batches = 0
        self._thread = threading.Thread(target=self._run, name="tandem-vllm-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                parts = self._socket.recv_multipart()
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return  # closed
            try:
                batch = self._decoder.decode(parts[-1])
            except Exception as err:  # a message this reader does not know: skip it, keep reading
                logger.warning("unreadable KV event batch: %s", err)
                continue
            for event in batch.events:
                self.index.apply(event)
            self.batches += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close(linger=0)
