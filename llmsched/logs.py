"""Logging for the three services: one handler on stderr, as text or as one
JSON object per line (`LOG_FORMAT=json`), and the opt-in request log.

In JSON mode everything the Python side prints goes through this handler:
log records, warnings, uncaught exceptions (in the main thread and in
others) and the one-line start-up refusal. Each object has `ts` (UTC,
ISO 8601 with milliseconds), `level`, `service`, `logger` and `msg`, plus
`exc` with the traceback when there is one. A request-log line adds its
fields at the top level, so a log pipeline can filter on `request_id`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import BeforeValidator

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The request log's logger; one line per request at INFO.
REQUESTS = "requests"


class TextFormatter(logging.Formatter):
    """The plain format; a record's fields (the request log's) follow its
    message as `key=value` pairs."""

    def __init__(self):
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        return f"{line} {logfmt(fields)}" if fields else line


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            obj.update(fields)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        elif record.stack_info:
            obj["exc"] = self.formatStack(record.stack_info)
        # default=str: a field that is not JSON (an enum, a path) is still one line.
        return json.dumps(obj, ensure_ascii=False, default=str)


def setup(service: str, level: str = "INFO", fmt: str = "text") -> None:
    """Configures the root logger for a service process; safe to call again
    (the start-up refusal may configure it before the settings are read)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # warnings.warn (torch's, transformers') as log records, not bare stderr lines.
    logging.captureWarnings(True)
    log = logging.getLogger(service)

    def on_uncaught(exc_type, exc, tb) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            sys.__excepthook__(exc_type, exc, tb)
            return
        log.critical("uncaught exception", exc_info=(exc_type, exc, tb))

    def on_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        log.critical("uncaught exception in thread %s", args.thread.name if args.thread else "?",
                     exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    sys.excepthook = on_uncaught
    threading.excepthook = on_uncaught_in_thread


def format_from_env(prefix: str) -> str:
    """The format a service was asked for, read before its settings are:
    `<PREFIX>_LOG_FORMAT`, else `LOG_FORMAT`; text unless one says json."""
    raw = os.environ.get(f"{prefix}_LOG_FORMAT") or os.environ.get("LOG_FORMAT") or "text"
    return "json" if raw.strip().lower() == "json" else "text"


def is_json() -> bool:
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def _logfmt_value(value: object) -> str:
    text = "-" if value is None else str(value)
    return json.dumps(text, ensure_ascii=False) if (not text or any(c in text for c in ' "=\n')) else text


def logfmt(fields: Mapping[str, object]) -> str:
    return " ".join(f"{k}={_logfmt_value(v)}" for k, v in fields.items())


def log_request(logger: logging.Logger, fields: Mapping[str, object]) -> None:
    """One request-log line, its message `request`: the fields as
    `key=value` pairs in text mode, as the object's own keys in JSON mode.
    A refusal's reason is one of the fields."""
    logger.info("request", extra={"fields": dict(fields)})


def _upper(value: object) -> object:
    return value.upper() if isinstance(value, str) else value


# The settings' types, shared by the three services' classes.
LogLevel = Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], BeforeValidator(_upper)]
LogFormat = Literal["text", "json"]
LOG_LEVEL_HELP = "Python log level, in any case."


def log_format_help(service: str) -> str:
    return (f"`text`, or `json`: every line the {service} prints is then one JSON object (`ts`, `level`, "
            "`service`, `logger`, `msg`, `exc`, and a request-log line's fields). Unset, the shared `LOG_FORMAT` "
            "is read, so `LOG_FORMAT=json` sets all three services.")
