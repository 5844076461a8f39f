"""The one error type a service's main() turns into a one-line message and
exit code 1: a setting or file that keeps the service from starting.
Anything else keeps its traceback, because it is a bug."""

from __future__ import annotations

import sys


class StartupError(Exception):
    """Says which setting or file is wrong, e.g.
    `EXECUTOR_PORT=50052: address already in use`."""


def exit_with(service: str, exc: StartupError) -> None:
    one_line = " ".join(str(exc).split())
    print(f"{service}: cannot start: {one_line}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def load_settings(cls):
    """cls() for a pydantic-settings class, with a bad variable reported as
    a StartupError naming it (`EXECUTOR_PORT='abc': Input should be ...`)."""
    from pydantic import ValidationError

    try:
        return cls()
    except ValidationError as exc:
        prefix = cls.model_config.get("env_prefix", "")
        problems = [f"{prefix}{'_'.join(map(str, e['loc'])).upper()}={e.get('input')!r}: {e['msg']}"
                    for e in exc.errors()]
        raise StartupError("; ".join(problems)) from None
