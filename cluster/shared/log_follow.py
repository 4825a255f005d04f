"""Ray's JSON log lines to standard output: what the ``ray-logs`` sidecar of each Ray pod runs
(``tandem logs follow``), so that ``kubectl logs`` and a node's log agent see them.

Ray keeps every process's logs in files under ``<temp dir>/session_latest/logs`` and its Serve
processes write JSON only there (their standard error gets Serve's text format). With
``serve.log_format: json`` the JSON lines are Serve's (``serve/*.log``: replica and ingress
records and one access line per call, each with its ``request_id``) and the engine cores'
(``worker-*.err``: the replicas' standard error, where everything else is Ray's text). The
follower prints, in the order it reads them, each complete line of those files that is a
JSON object; text lines stay in the files. A file it has not seen is read from its start, a
file replaced under the same name (rotated, or a new Ray session behind ``session_latest``)
from the start of the new one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

PATTERNS = ("serve/*.log", "worker-*.err")


@dataclass
class _Position:
    inode: int
    offset: int


class LogFollower:
    def __init__(self, logs_dir: str | Path, out: BinaryIO) -> None:
        self.logs_dir = Path(logs_dir)
        self.out = out
        self._positions: dict[Path, _Position] = {}  # by the file's resolved path

    def poll(self) -> int:
        """Print what was appended since the last poll; returns the number of lines printed."""
        printed = 0
        for pattern in PATTERNS:
            for path in sorted(self.logs_dir.glob(pattern)):
                printed += self._read(path)
        if printed:
            self.out.flush()
        return printed

    def _read(self, path: Path) -> int:
        try:
            real = path.resolve()
            with open(real, "rb") as file:
                stat = os.fstat(file.fileno())
                known = self._positions.get(real)
                if known is None or known.inode != stat.st_ino or stat.st_size < known.offset:
                    known = self._positions[real] = _Position(stat.st_ino, 0)
                if stat.st_size == known.offset:
                    return 0
                file.seek(known.offset)
                data = file.read(stat.st_size - known.offset)
        except FileNotFoundError:  # removed between the listing and the read
            return 0
        end = data.rfind(b"\n") + 1  # complete lines only; a partial one waits for its end
        known.offset += end
        printed = 0
        for line in data[:end].splitlines():
            if line.startswith(b"{") and line.rstrip().endswith(b"}"):
                self.out.write(line.rstrip() + b"\n")
                printed += 1
        return printed

    def run(self, interval_s: float = 0.5) -> None:
        """Poll forever (the sidecar's life)."""
        while True:
            self.poll()
            time.sleep(interval_s)


def main(argv: list[str] | None = None) -> int:
    """``python -m cluster.shared.log_follow [--dir DIR]``: a light process (no torch, no Ray)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m cluster.shared.log_follow",
                                     description="print the JSON lines of Ray's log files as they are written")
    parser.add_argument("--dir", default="/tmp/ray/session_latest/logs", help="Ray's logs folder (default: %(default)s)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between two looks (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        LogFollower(args.dir, sys.stdout.buffer).run(args.interval)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
