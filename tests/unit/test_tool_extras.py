"""The serving library runs without the tools' extras (pyproject's ``bench`` and ``dashboards``), and
a tool whose extra is missing says which one to install. Checked in fresh interpreters where the
extras' packages cannot be imported (a finder that refuses them)."""

from __future__ import annotations

import subprocess
import sys

BLOCK = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('rich', 'matplotlib', 'aiohttp', 'grafana_client'):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Refuse())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=300)


def test_the_server_imports_without_the_tools_extras():
    done = _run("import deployments.app, deployments.local, deployments.ingress, cluster.backends.factory, "
                "cluster.hosting.core_process, cluster.cli; print('ok')")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_tool_without_its_extra_names_the_extra():
    done = _run("from cluster.cli import main; sys.exit(main(['bench', 'offline']))")
    assert done.returncode == 2
    assert "`tandem bench` needs rich" in done.stderr and "tandem-serve[bench]" in done.stderr
    pushed = _run("from cluster.cli import main; "
                  "sys.exit(main(['dashboards', 'push', '--url', 'http://127.0.0.1:9', '--token', 't']))")
    assert pushed.returncode == 2 and "tandem-serve[dashboards]" in pushed.stderr, pushed.stderr


def test_the_refusal_is_only_for_missing_extras():
    """Where the extras are installed (make install), the finder above is what makes them missing."""
    done = subprocess.run([sys.executable, "-c", "import rich, matplotlib, aiohttp, grafana_client"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
