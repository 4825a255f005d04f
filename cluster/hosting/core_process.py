"""The engine core's own process: ``python -m cluster.hosting.core_process FD``.

``ProcessClient`` starts it with one end of a socket pair. It reads ``CoreStart``, builds the
engine, answers ``CoreReady`` (or a ``CoreMessage`` with ``failure`` when the engine cannot
be built) and then serves ``EngineCore.run`` until the replica closes its end or sends
``Shutdown``.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import traceback
from multiprocessing.connection import Connection

from cluster.config import config_from_dict
from cluster.engine.engine import Engine
from cluster.hosting.core import EngineCore, close_engine
from cluster.hosting.core_messages import CoreMessage, CoreReady, CoreStart
from cluster.shared.json_logs import use_json_lines

logger = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    conn = Connection(int(argv[0]))
    try:
        start: CoreStart = conn.recv()
        config = config_from_dict(start.config, "engine core config")
        if config.serve.log_format == "json":
            use_json_lines("engine-core")
        engine = Engine(config)
        core = EngineCore(engine, start.step_time_scale)
        # What start-up made (the model, compiled graphs, tokenizer) lives as long as the core: frozen out
        # of the collector, an oldest-generation pass no longer walks it (on a GPU such a pass took
        # 130-460 ms unfrozen, a stall in whichever step it fell; frozen, about 16 ms).
        gc.collect()
        gc.freeze()
        conn.send(CoreReady(engine.max_model_len, core.snapshot(), os.getpid()))
    except EOFError:
        return 0
    except Exception as err:
        logger.exception("the engine core could not start")
        conn.send(CoreMessage(failure=f"the engine could not start: {type(err).__name__}: {err}\n"
                                      f"{traceback.format_exc(limit=5)}"))
        return 1
    try:
        core.run(conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the replica went away
    finally:
        close_engine(engine)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
