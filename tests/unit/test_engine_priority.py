"""The engine core takes nice 0 for every thread where the process may lower its niceness (as
under Ray, whose workers start at 15), and says so; where it may not, it keeps what it inherited
and says why."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, os, threading
os.nice(7)  # as a Ray worker's child inherits 15
stop = threading.Event()
helper = threading.Thread(target=stop.wait)  # a thread made before the call is reniced too
helper.start()
from cluster.hosting.core_process import take_engine_priority
message = take_engine_priority()
nices = sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")})
stop.set()
print(json.dumps([message, nices]))
"""


def test_the_core_takes_nice_0_where_it_may_and_says_what_it_runs_at():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    message, nices = json.loads(out.strip().splitlines()[-1])
    if nices == [0]:
        assert message == "the engine core runs at nice 0 (inherited 7)", message
    else:  # no CAP_SYS_NICE here: every thread keeps 7 and the line says why
        assert nices == [7], nices
        assert "runs at nice 7 as inherited" in message and "CAP_SYS_NICE" in message, message
