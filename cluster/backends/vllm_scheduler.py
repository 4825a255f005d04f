"""vLLM's scheduler, with a batch-size -> k schedule that follows the replica's controller.

A vLLM group whose controller is ``adaptive`` names :func:`following_scheduler` as vLLM's
``scheduler_cls``; vLLM's engine-core process builds its scheduler through it. Before each
step the scheduler reads the schedule file the replica rewrites (``vllm_k_schedule.py``, its
path in ``TANDEM_VLLM_K_SCHEDULE``) and, when a newer version is there, rebuilds vLLM's own
dense lookup from it with vLLM's own function, so vLLM's dynamic speculation picks every
step's k from the table in force. Imported only inside vLLM's process (it imports vLLM).
"""

from __future__ import annotations

import logging
import os

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

from cluster.backends.vllm_k_schedule import ENV, ScheduleFile

logger = logging.getLogger(__name__)


class _FollowsSchedule:
    """Mixed into vLLM's Scheduler or AsyncScheduler, whichever vLLM would have run."""

    def schedule(self, *args, **kwargs):
        self._follow_schedule()
        return super().schedule(*args, **kwargs)

    def _follow_schedule(self) -> None:
        if not hasattr(self, "_k_schedule"):
            path = os.environ.get(ENV)
            self._k_schedule = ScheduleFile(path) if path else None
            if path is None:
                logger.warning("%s is unset: vLLM keeps the batch-size schedule it started with", ENV)
        if self._k_schedule is None or self.dynamic_sd_lookup is None:
            return
        ranges = self._k_schedule.read_if_changed()
        if ranges is not None:
            self.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup(
                ranges, self.scheduler_config.max_num_seqs, self.num_spec_tokens)
            logger.info("speculation schedule %d in force: %s", self._k_schedule.version, ranges)


class FollowingScheduler(_FollowsSchedule, Scheduler):
    pass


class FollowingAsyncScheduler(_FollowsSchedule, AsyncScheduler):
    pass


def following_scheduler(*args, **kwargs):
    """vLLM's scheduler constructor: the following form of the class vLLM would have chosen
    (asynchronous scheduling on or off, as its config resolved it)."""
    vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
    cls = FollowingAsyncScheduler if vllm_config.scheduler_config.async_scheduling else FollowingScheduler
    return cls(*args, **kwargs)
