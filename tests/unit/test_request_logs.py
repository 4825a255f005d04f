"""Log lines that name requests: the engine core's line per request's start and end
(``serve.log_requests``) and the JSON-lines format (``serve.log_format: json``)."""

from __future__ import annotations

import json
import logging
import time

from cluster.config import TandemConfig, with_overrides
from cluster.engine.engine import Engine
from cluster.hosting.core import EngineCore
from cluster.hosting.core_messages import AddRequest, AbortRequest
from cluster.hosting.protocol import GenerateRequest
from cluster.shared.json_logs import JsonLineFormatter
from cluster.shared.sampling_params import SamplingParams
from tests.engine_helpers import make_engine


def test_the_core_logs_each_request_by_id_when_asked(tiny_llama_dir, caplog):
    config = with_overrides(TandemConfig(), model=str(tiny_llama_dir), device="cpu")
    engine = Engine(config.model_copy(update={"serve": config.serve.model_copy(update={"log_requests": True})}))
    core = EngineCore(engine)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="cluster.hosting.core"):
        core.handle(AddRequest(GenerateRequest("cmpl-trace-1-ab-0", [5, 6, 7], params)))
        core.handle(AddRequest(GenerateRequest("cmpl-trace-2-cd-0", [5, 6, 7, 8], SamplingParams(max_tokens=64))))
        core.handle(AddRequest(GenerateRequest("cmpl-bad-0", [5] * 10_000, params)))  # longer than the context
        while engine.has_unfinished() and "cmpl-trace-1-ab-0" in engine.scheduler.requests:
            assert core.step()
        core.handle(AbortRequest("cmpl-trace-2-cd-0"))
        core.take_message(time.monotonic())
    lines = {(r.request_id, r.getMessage().split(":")[0].split()[-1]) for r in caplog.records}
    assert {("cmpl-trace-1-ab-0", "added"), ("cmpl-trace-1-ab-0", "finished"), ("cmpl-trace-2-cd-0", "added"),
            ("cmpl-trace-2-cd-0", "aborted"), ("cmpl-bad-0", "refused")} <= lines
    quiet = EngineCore(make_engine(tiny_llama_dir))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cluster.hosting.core"):
        quiet.handle(AddRequest(GenerateRequest("cmpl-x-0", [5, 6], params)))
    assert not caplog.records  # off by default, as vLLM's


def test_json_lines_carry_the_request_id_and_the_exception():
    formatter = JsonLineFormatter("engine-core")
    record = logging.LogRecord("cluster.hosting.core", logging.INFO, __file__, 1, "request %s added", ("r-1",), None)
    record.request_id = "r-1"
    line = json.loads(formatter.format(record))
    assert line["message"] == "request r-1 added" and line["request_id"] == "r-1"
    assert line["levelname"] == "INFO" and line["component"] == "engine-core"
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "step failed", (), sys.exc_info())
    assert "RuntimeError: boom" in json.loads(formatter.format(failed))["exc_text"]
