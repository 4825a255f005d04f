"""Running the target model over ``tensor_parallel_size`` ranks inside one engine.

The engine's process is rank 0, the *driver*: it schedules, runs the draft model,
samples, and holds a :class:`TensorParallelRunner`, which is a ``ModelRunner`` whose
forward pass first broadcasts the step's batch description (token ids, positions and
block tables: a few kilobytes) to the other ranks. Ranks 1..tp-1 are started by a
launcher (local ``spawn`` processes, or Ray actors: :mod:`cluster.runner.tp_launcher`);
each runs :func:`cluster.runner.tp_rank.run_worker`: it loads its shard, allocates its
part of the KV cache (the same number of blocks on every rank), then runs the same
forward on every batch it receives until the driver sends ``None``.

Failure: before each step the driver checks that every worker rank is alive and
raises :class:`TensorParallelError` if one is gone; a rank that dies *during* a step
makes the step's collective fail (gloo sees the closed connection) or time out after
``parallel.collective_timeout_s``. Either way the step raises instead of hanging, and
the engine core fails the in-flight requests with a 500 and reports itself failed.
"""

from __future__ import annotations

import logging
import time
import weakref

import torch

from cluster.config import TandemConfig
from cluster.models.loader import load_hf_config, resolve_model
from cluster.parallel.group import init_group, open_store
from cluster.parallel.layers import divide, head_shard
from cluster.runner.attention_choice import choose_attention
from cluster.runner.input_batch import SeqChunk
from cluster.runner.model_runner import ModelRunner
from cluster.runner.tp_launcher import RankLauncher, RankProcess, SpawnLauncher
from cluster.runner.tp_rank import StepMessage, gloo_host
from cluster.runner.worker import Worker, load_model, num_kv_blocks, use_step_threads
from cluster.shared.device import default_device

logger = logging.getLogger(__name__)

_POLL_S = 0.05


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or died; the engine cannot step any more."""


def rank_device(config: TandemConfig, rank: int, isolated: bool) -> torch.device:
    """CPU ranks share the CPU. CUDA rank ``r`` uses the ``r``-th GPU after the configured
    one, or, when each rank sees only its own GPU (``isolated``, under Ray), cuda:0."""
    device = default_device(config.device.device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", 0 if isolated else (device.index or 0) + rank)


def check_model_splits(hf_config, tp_size: int) -> None:
    """Raise ValueError, before any process starts, if the model does not split ``tp_size`` ways."""
    heads = hf_config.num_attention_heads
    head_shard(heads, getattr(hf_config, "num_key_value_heads", None) or heads, tp_size, 0)
    ffn = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "ffn_dim", None)
    if ffn is not None:
        divide(ffn, tp_size, "the MLP's intermediate size")


class TensorParallelExecutor:
    """Owns the worker ranks of one engine and the driver's end of the group."""

    def __init__(self, config: TandemConfig, launcher: RankLauncher | None = None) -> None:
        launcher = launcher or SpawnLauncher()
        self.tp_size = config.parallel.tensor_parallel_size
        timeout_s = config.parallel.collective_timeout_s
        store, address = open_store(launcher.store_host)
        self.ranks: list[RankProcess] = []
        self.serving = False  # every rank is in its step loop (set by start_tensor_parallel)
        self._finalizer = weakref.finalize(self, _stop_ranks, self.ranks)
        try:
            for rank in range(1, self.tp_size):
                device = str(rank_device(config, rank, launcher.isolates_devices))
                self.ranks.append(launcher.launch(config, rank, address, device))
            # Starting a rank (imports, a Ray actor) may take long on a busy host; only
            # once all are up does joining the groups run under the collective timeout.
            self._await_ranks(store, "joined")
            device = rank_device(config, 0, launcher.isolates_devices)
            self.group = init_group(store, 0, self.tp_size, device, timeout_s, gloo_host(address))
        except TensorParallelError:
            self.close()
            raise
        except Exception as err:
            self.close()
            raise TensorParallelError(f"tensor-parallel ranks could not join one group: {err}") from err

    def wait_ready(self) -> None:
        """Block until every worker has loaded its shard; raise the first worker's load error."""
        self._await_ranks(self.group.store, "ready")

    def _await_ranks(self, store, stage: str) -> None:
        """Poll until every worker set ``{stage}/{rank}``; a worker's ``failed/{rank}`` or its
        exit raises. No timeout: a rank that is alive is making progress."""
        pending = set(range(1, self.tp_size))
        while pending:
            for rank in sorted(pending):
                if store.check([f"failed/{rank}"]):
                    message = store.get(f"failed/{rank}").decode()
                    self.close()
                    raise TensorParallelError(f"tensor-parallel rank {rank} failed to load: {message}")
                if store.check([f"{stage}/{rank}"]):
                    pending.discard(rank)
            if pending:
                self.check_alive()
                time.sleep(_POLL_S)

    def check_alive(self) -> None:
        """Raise TensorParallelError if a worker rank has stopped."""
        for rank, process in enumerate(self.ranks, start=1):
            if not process.is_alive():
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} exited ({process.exit_reason()}); "
                    "this engine cannot run its model any more"
                )

    def send_step(self, message: StepMessage | None) -> None:
        self.check_alive()
        self.group.broadcast_object(message)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the workers to stop (once they serve steps), then end any that do not; idempotent."""
        if self.serving and all(r.is_alive() for r in self.ranks):
            self.serving = False
            try:
                self.group.broadcast_object(None)
                deadline = time.monotonic() + timeout_s
                for process in self.ranks:
                    process.join(max(0.0, deadline - time.monotonic()))
            except Exception:  # a worker went away meanwhile; terminate below
                pass
        self._finalizer()  # terminates the ranks still running


def _stop_ranks(ranks: list[RankProcess]) -> None:
    for process in ranks:
        if process.is_alive():
            process.terminate()


class TensorParallelRunner(ModelRunner):
    """The driver's runner: each forward pass is announced to the other ranks first."""

    def __init__(self, executor: TensorParallelExecutor, *args) -> None:
        super().__init__(*args)
        self.executor = executor
        self.failed: str | None = None

    def forward_logits(self, chunks: list[SeqChunk], block_tables: list[list[int]]) -> torch.Tensor:
        """Raises TensorParallelError when a rank is gone or a collective fails; after that
        every call raises (the ranks are out of step for good)."""
        if self.failed is not None:
            raise TensorParallelError(f"tensor-parallel engine failed earlier: {self.failed}")
        try:
            self.executor.send_step(StepMessage(chunks, block_tables))
            return super().forward_logits(chunks, block_tables)
        except TensorParallelError as err:
            self.failed, self.executor.serving = str(err), False
            raise
        except RuntimeError as err:  # gloo/NCCL: a peer closed its connection or the timeout passed
            self.failed, self.executor.serving = f"a collective failed (did a rank die?): {err}", False
            raise TensorParallelError(self.failed) from err


class TensorParallelWorker(Worker):
    """The driver rank's worker; ``close`` stops the other ranks."""

    def close(self) -> None:
        self.runner.executor.close()


def start_tensor_parallel(config: TandemConfig, launcher: RankLauncher | None = None) -> TensorParallelWorker:
    """Start ranks 1..tp-1 (local processes unless ``launcher`` says otherwise), load the
    driver's shard, and return the driver's worker."""
    tp_size = config.parallel.tensor_parallel_size
    check_model_splits(load_hf_config(resolve_model(config.model.model, config.model.cache_dir)), tp_size)
    launcher = launcher or SpawnLauncher()
    last = rank_device(config, tp_size - 1, launcher.isolates_devices)
    if last.type == "cuda" and last.index >= torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {tp_size} from {config.device.device!r} needs GPU {last.index}, "
                         f"but this host has {torch.cuda.device_count()} GPUs")
    if config.device.num_threads:
        torch.set_num_threads(config.device.num_threads)
    started = time.monotonic()
    executor = TensorParallelExecutor(config, launcher)
    try:
        device = executor.group.device
        loaded = load_model(config, device, executor.group)
        executor.wait_ready()
        num_blocks = executor.group.min_int(num_kv_blocks(config, loaded.spec, device))
        runner = TensorParallelRunner(executor, loaded.model, num_blocks, loaded.spec, device, False,
                                      config.speculative.verification, config.speculative.method in ("draft", "eagle3"),
                                      choose_attention(config, device, loaded.max_model_len, True))
        use_step_threads(config, device)
        executor.serving = True
    except BaseException:
        executor.close()
        raise
    logger.info("loaded %s over %d ranks (%s, %s) in %.1fs; KV cache: %d blocks of %d tokens per rank",
                config.model.model, executor.tp_size, loaded.dtype, device, time.monotonic() - started,
                num_blocks, loaded.spec.block_size)
    return TensorParallelWorker(runner, loaded.tokenizer, loaded.hf_config, loaded.max_model_len)
