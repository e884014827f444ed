"""Log lines as Prometheus' Go exporters write them: logfmt (default) or JSON, on stderr.

``--log.format=logfmt``::

    ts=2026-11-25T04:29:42.123Z level=info caller=daemon.py:88 msg="listening on :9400"

``--log.format=json``::

    {"ts": "2026-11-25T04:29:42.123Z", "level": "info", "caller": "daemon.py:88", "msg": "…"}

A record may carry more keys as ``extra={"fields": {...}}`` (the request log does:
``method``, ``path``, ``status``…); they follow ``msg`` in order. An exception's traceback
goes into ``err``, escaped onto the one line. ``--log.level`` takes Go's ``warn`` as well as
Python's ``warning``.

>>> record = logging.LogRecord("gpu_exporter", logging.INFO, "/x/daemon.py", 88,
...                            'say "hi"', None, None)
>>> record.created, record.msecs = 0.0, 0.0
>>> LogfmtFormatter().format(record)
'ts=1970-01-01T00:00:00.000Z level=info caller=daemon.py:88 msg="say \\\\"hi\\\\""'
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TextIO

LOG_FORMATS = ("logfmt", "json")
LOG_LEVEL_NAMES = ("debug", "info", "warn", "warning", "error")
# logging's level names → the Go exporters' (--log.level takes both)
LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error"}


def level_name(text: str) -> str:
    """``--log.level``'s value as :mod:`logging` names it: ``warn`` → ``warning``."""
    text = text.strip().lower()
    return "warning" if text == "warn" else text


def _fields(record: logging.LogRecord) -> Iterator[tuple[str, Any]]:
    yield "ts", _timestamp(record)
    yield "level", LOG_LEVELS.get(record.levelname.lower(), record.levelname.lower())
    yield "caller", f"{os.path.basename(record.pathname)}:{record.lineno}"
    yield "msg", record.getMessage()
    extra = getattr(record, "fields", None)
    if isinstance(extra, Mapping):
        yield from extra.items()
    if record.exc_info:
        yield "err", logging.Formatter().formatException(record.exc_info)


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _logfmt_value(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    if text and not any(c in text for c in ' ="\\') and text.isprintable():
        return text
    return json.dumps(text, ensure_ascii=False)  # quoted, with \" \\ \n escaped


class LogfmtFormatter(logging.Formatter):
    """``key=value`` pairs, a value quoted when it has a space, ``=`` or a quote."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{key}={_logfmt_value(value)}" for key, value in _fields(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(dict(_fields(record)), ensure_ascii=False, default=str)


def setup(level: str = "info", fmt: str = "logfmt", stream: TextIO | None = None) -> None:
    """Send every log record of ``level`` or above to ``stream`` (stderr) in ``fmt``."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(LogfmtFormatter() if fmt == "logfmt" else JsonFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level_name(level).upper())


def add_flags(
    parser: argparse.ArgumentParser, level: str | None, env: Callable[[str, str | None], str | None]
) -> None:
    """``--log-level``/``--log.level`` (default ``level``) and ``--log.format`` for ``serve``;
    ``env(flag, default)`` reads ``GPU_EXPORTER_<FLAG>``."""
    parser.add_argument(
        "--log-level",
        "--log.level",
        dest="log_level",
        choices=LOG_LEVEL_NAMES,
        default=level,
        help="debug (adds one line per request), info, warn or error (default %(default)s)",
    )
    parser.add_argument(
        "--log.format",
        dest="log_format",
        choices=LOG_FORMATS,
        default=env("log.format", "logfmt"),
        help="logfmt (ts=… level=info caller=… msg=…, as Prometheus' Go exporters) or json: "
        "one object per line (default %(default)s)",
    )
