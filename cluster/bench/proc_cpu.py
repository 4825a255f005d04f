"""CPU taken by every process on the machine over an interval, read from /proc (Linux).

``ProcessCpuSampler`` reads each thread's user + system ticks when started and when stopped
(a thread that started in between counts from 0; one that ended is missed) and reports, per
process, the share of one core it used (100 = one core busy) with its busiest threads, named
by command line (Ray's worker processes by their ``ray::`` title). Beside them, the CPU of
this process's children that ended and were waited for in the interval (a benchmark's
client run to completion), which the threads' reading misses. It is how ``tandem bench
served`` shows where a saturated machine's time goes.
"""

from __future__ import annotations

import os
import resource
import time

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _thread_ticks() -> dict[tuple[int, int], tuple[str, int]]:
    ticks = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
                name = stat[stat.index("(") + 1: stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2:].split()
                ticks[(int(pid), int(tid))] = (name, int(fields[11]) + int(fields[12]))
        except (OSError, ValueError):
            continue  # the process or thread ended meanwhile
    return ticks


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
    return words[:80] or "?"


class ProcessCpuSampler:
    def __init__(self) -> None:
        self._start: dict | None = None
        self._started_at = 0.0

    def start(self) -> None:
        self._start = _thread_ticks()
        self._children_start = _children_seconds()
        self._started_at = time.monotonic()

    def stop(self, top: int = 8) -> dict:
        """Per process (the ``top`` busiest): percent of one core, command, busiest threads."""
        end = _thread_ticks()
        seconds = max(1e-6, time.monotonic() - self._started_at)
        per_process: dict[int, float] = {}
        threads: dict[int, list[tuple[float, str]]] = {}
        for key, (name, value) in end.items():
            before = self._start.get(key, (name, 0))  # a thread started meanwhile counts from 0
            percent = 100.0 * (value - before[1]) / _TICKS / seconds
            per_process[key[0]] = per_process.get(key[0], 0.0) + percent
            threads.setdefault(key[0], []).append((percent, name))
        busiest = sorted(per_process.items(), key=lambda item: -item[1])[:top]
        return {
            "seconds": seconds,
            "total_percent": sum(per_process.values()),
            "ended_children_percent": round(100.0 * (_children_seconds() - self._children_start) / seconds, 1),
            "cores": len(os.sched_getaffinity(0)),
            "processes": [{"pid": pid, "command": _command(pid), "percent": round(percent, 1),
                           "threads": [(name, round(p, 1)) for p, name in sorted(threads[pid], reverse=True)[:3]]}
                          for pid, percent in busiest],
        }


def _children_seconds() -> float:
    """User + system seconds of this process's children that ended and were waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
