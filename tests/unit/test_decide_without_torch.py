"""The scheduler and the KV cache manager decide and never compute: importing them (and all
they import) loads no torch. import-linter checks the import graph (``make test``); this checks
what a fresh interpreter actually loads."""

from __future__ import annotations

import subprocess
import sys


def test_the_scheduler_and_the_kv_manager_load_no_torch():
    code = ("import sys; import cluster.engine.scheduler, cluster.kv.block_manager; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"


def test_the_check_would_see_torch_if_it_were_loaded():
    code = "import sys; import cluster.shared.draft_proposal; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "True"
