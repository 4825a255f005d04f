"""Where fetched and converted weights, built kernels and drafts are kept."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$TANDEM_CACHE_DIR`` if set, else ``~/.cache/tandem``."""
    env = os.environ.get("TANDEM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tandem"
