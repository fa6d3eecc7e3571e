"""Logging for every pagedkv process: one format, `--log-level`, optional JSON lines, and
repeated warnings rate-limited.

    2026-12-01T22:14:07.123Z WARNING pagedkv.node.link: coordinator unreachable ...
    {"ts": "2026-12-01T22:14:07.123Z", "level": "WARNING", "logger": "pagedkv.node.link", "msg": "..."}

A retry loop (a node without its coordinator, a coordinator without Redis) logs the same
warning on every attempt; `RepeatFilter` lets the first through, then at most one per
`interval_s` for each (logger, message template), with the number it held back, so an outage
reads as a handful of lines instead of one per second forever.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")


def log_level(text: str) -> str:
    """argparse type for --log-level: a level name, any case."""
    level = text.strip().upper()
    if level not in LEVELS:
        raise argparse.ArgumentTypeError(f"--log-level {text!r}: choose one of {', '.join(LEVELS)}")
    return level


def add_logging_args(p: argparse.ArgumentParser) -> None:
    """--log-level and --log-format, defaulting to PAGEDKV_LOG_LEVEL / PAGEDKV_LOG_FORMAT."""
    p.add_argument(
        "--log-level",
        type=log_level,
        default=os.environ.get("PAGEDKV_LOG_LEVEL", "INFO"),
        help=f"{', '.join(LEVELS)} [PAGEDKV_LOG_LEVEL] (default INFO)",
    )
    p.add_argument(
        "--log-format",
        choices=FORMATS,
        default=os.environ.get("PAGEDKV_LOG_FORMAT", "text"),
        help="text lines or one JSON object per line [PAGEDKV_LOG_FORMAT] (default text)",
    )


def _timestamp(record: logging.LogRecord) -> str:
    t = time.gmtime(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class RepeatFilter(logging.Filter):
    """Passes a WARNING-or-above record the first time its (logger, template) is seen, then at
    most once per `interval_s`, suffixed with how many were held back. Lower levels pass."""

    def __init__(self, interval_s: float = 30.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}  # -> (last passed, held back since)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            last, held = self._seen.get(key, (None, 0))
            if last is not None and now - last < self.interval_s:
                self._seen[key] = (last, held + 1)
                return False
            self._seen[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like this in the last {now - last:.0f}s)"  # type: ignore[operator]
        return True


def setup_logging(level: str = "INFO", fmt: str = "text", *, repeat_interval_s: float = 30.0) -> None:
    """Configure the root logger for a pagedkv process (stderr), replacing earlier handlers."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RepeatFilter(repeat_interval_s))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
