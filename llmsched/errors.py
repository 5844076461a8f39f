"""The one error type a service's main() turns into a one-line message and
exit code 1: a setting or file that keeps the service from starting.
Anything else keeps its traceback, because it is a bug."""

from __future__ import annotations

import logging
import os
import sys

from llmsched import logs


class StartupError(Exception):
    """Says which setting or file is wrong, e.g.
    `EXECUTOR_PORT=50052: address already in use`."""


def exit_with(service: str, exc: StartupError) -> None:
    one_line = " ".join(str(exc).split())
    if logs.is_json():
        logging.getLogger(service).critical("cannot start: %s", one_line)
    else:
        print(f"{service}: cannot start: {one_line}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def load_settings(cls):
    """cls() for a pydantic-settings class, with a bad variable reported as
    a StartupError naming it (`EXECUTOR_PORT='abc': Input should be ...`)."""
    from pydantic import ValidationError

    try:
        return cls()
    except ValidationError as exc:
        problems = [f"{_variable(cls, e['loc'])}={e.get('input')!r}: {e['msg']}" for e in exc.errors()]
        raise StartupError("; ".join(problems)) from None


def _variable(cls, loc: tuple) -> str:
    """The environment variable behind an error's location. A field with
    several names (SCHEDULER_LOG_FORMAT, else LOG_FORMAT) is reported by
    the one that is set."""
    prefix = cls.model_config.get("env_prefix", "")
    name = "_".join(map(str, loc)).upper()
    for field in cls.model_fields.values():
        choices = getattr(field.validation_alias, "choices", None)
        if choices and name in (str(c).upper() for c in choices):
            set_ = [str(c).upper() for c in choices if str(c).upper() in {k.upper() for k in os.environ}]
            return set_[0] if set_ else name
    return name if name.startswith(prefix) else f"{prefix}{name}"
