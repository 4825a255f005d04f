"""Log records as JSON lines, for collectors that parse container output (``serve.log_format:
json``), with the fields Ray Serve's own JSON logs use (``asctime``, ``levelname``, ``message``),
the logger and process, and a request's id when the record names one (``extra={"request_id": ...}``)."""

from __future__ import annotations

import json
import logging


class JsonLineFormatter(logging.Formatter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        line = {"asctime": self.formatTime(record), "levelname": record.levelname, "name": record.name,
                "component": self.component, "process": record.process, "message": record.getMessage()}
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            line["request_id"] = request_id
        if record.exc_info:
            line["exc_text"] = self.formatException(record.exc_info)
        return json.dumps(line)


def use_json_lines(component: str) -> None:
    """Every handler of the root logger writes JSON lines from now on."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(JsonLineFormatter(component))
