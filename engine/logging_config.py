"""Logging for every pdserve process: one line per event, key=value fields, quiet by default.

PDSERVE_LOG_LEVEL (default INFO: startup, shutdown and errors; per-request events are DEBUG)
and PDSERVE_LOG_FORMAT=json|text (default text) tune it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        line = f"{stamp} level={record.levelname} logger={record.name} pid={record.process} msg={record.getMessage()!r}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": record.created, "level": record.levelname, "logger": record.name, "pid": record.process,
               "msg": record.getMessage()}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def configure_logging(level: str | None = None) -> None:
    level = (level or os.environ.get("PDSERVE_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if os.environ.get("PDSERVE_LOG_FORMAT") == "json" else _TextFormatter())
    root = logging.getLogger("pdserve")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


class RateLimitedWarning:
    """A warning logged at most once per interval, counting what it held back; a flood of bad
    peers must not flood the log."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last = float("-inf")
        self._held_back = 0
        self._lock = threading.Lock()

    def __call__(self, message: str, *args: Any) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.interval_s:
                self._held_back += 1
                return
            held_back, self._held_back, self._last = self._held_back, 0, now
        suffix = f" ({held_back} more like it not logged)" if held_back else ""
        self.logger.warning(message + suffix, *args)
