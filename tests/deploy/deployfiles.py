"""Readers for the deployment files, for static checks without a Docker
engine: compose YAML (with its `!reset` tag, interpolation and override
merging), Dockerfiles (stages, ARGs, COPY, RUN, CMD) and .dockerignore.

Each follows Docker's rules only as far as the files in this repository
need; tests/deploy/test_deployfiles.py pins the behaviour relied on.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- compose


@dataclass(frozen=True)
class Reset:
    """A value tagged `!reset` in an override file: clears the base value."""

    value: Any


class ComposeLoader(yaml.SafeLoader):
    pass


def _reset(loader: yaml.SafeLoader, node: yaml.Node) -> Reset:
    if isinstance(node, yaml.SequenceNode):
        return Reset(loader.construct_sequence(node, deep=True))
    if isinstance(node, yaml.MappingNode):
        return Reset(loader.construct_mapping(node, deep=True))
    return Reset(loader.construct_scalar(node) or None)


ComposeLoader.add_constructor("!reset", _reset)
# `!override` replaces instead of merging; for these checks that is the same.
ComposeLoader.add_constructor("!override", _reset)


def load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


_INTERP = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])((?:[^{}]|\{[^{}]*\})*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolated_variables(text: str) -> list[tuple[str, str | None, str | None]]:
    """(name, operator, default) for each ${...} / $NAME in text; $$ skipped."""
    out = []
    for m in _INTERP.finditer(text):
        if m.group(1):
            continue
        out.append((m.group(2) or m.group(5), m.group(3), m.group(4)))
    return out


def interpolate(value: Any, env: dict[str, str] | None = None) -> Any:
    """Compose's variable substitution, recursively; env defaults to empty,
    so the result is what `docker compose up` does with no .env file."""
    env = env or {}
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, Reset):
        return Reset(interpolate(value.value, env))
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, arg = m.group(3), m.group(4)
        have = env.get(name)
        if op in (":-", "-"):
            use_default = have is None or (op == ":-" and have == "")
            return interpolate(arg, env) if use_default else have
        if op in (":+", "+"):
            present = have is not None and (op == "+" or have != "")
            return interpolate(arg, env) if present else ""
        if op in (":?", "?") and (have is None or (op == ":?" and have == "")):
            raise KeyError(f"${{{name}}} is required: {arg}")
        return have or ""

    return _INTERP.sub(sub, value)


_REPLACED_KEYS = {"command", "entrypoint", "test"}


def merge(base: Any, override: Any, key: str | None = None) -> Any:
    """Merges an override file's value into the base file's, as compose
    does: mappings merge key by key, `!reset` replaces, most sequences
    (ports, expose, volumes, devices) are unions, commands are replaced."""
    if isinstance(override, Reset):
        return override.value
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = merge(base[k], v, k) if k in base else strip_resets(v)
        return out
    if isinstance(base, list) and isinstance(override, list) and key not in _REPLACED_KEYS:
        return base + [v for v in override if v not in base]
    return strip_resets(override)


def strip_resets(value: Any) -> Any:
    if isinstance(value, Reset):
        return value.value
    if isinstance(value, dict):
        return {k: strip_resets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strip_resets(v) for v in value]
    return value


def load_compose(*paths: Path, env: dict[str, str] | None = None) -> dict:
    """The effective model of `docker compose -f a -f b ...`, interpolated."""
    model: dict = {}
    for path in paths:
        model = merge(model, load_yaml(path)) if model else strip_resets(load_yaml(path))
    return interpolate(model, env)


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        pairs = (item.split("=", 1) if "=" in item else (item, "") for item in env)
        env = dict(pairs)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


@dataclass(frozen=True)
class PortMapping:
    host_ip: str | None
    published: int | None
    target: int


def port_mappings(service: dict) -> list[PortMapping]:
    out = []
    for spec in service.get("ports") or []:
        if isinstance(spec, dict):
            published = spec.get("published")
            out.append(PortMapping(spec.get("host_ip"), int(published) if published else None, int(spec["target"])))
            continue
        spec = str(spec).split("/")[0]
        parts = spec.rsplit(":", 2)
        if len(parts) == 1:
            out.append(PortMapping(None, None, int(parts[0])))
        elif len(parts) == 2:
            out.append(PortMapping(None, int(parts[0]), int(parts[1])))
        else:
            out.append(PortMapping(parts[0] or None, int(parts[1]), int(parts[2])))
    return out


def exposed_ports(service: dict) -> set[int]:
    """Container ports other services can reach: `expose` and `ports` targets."""
    ports = {int(str(p).split("/")[0]) for p in service.get("expose") or []}
    return ports | {m.target for m in port_mappings(service)}


def commands(service: dict) -> list[list[str]]:
    """The argv lists a service runs: command and the healthcheck test."""
    out = []
    command = service.get("command")
    if isinstance(command, str):
        out.append(shlex.split(command))
    elif command:
        out.append([str(c) for c in command])
    test = (service.get("healthcheck") or {}).get("test")
    if isinstance(test, str):
        out.append(shlex.split(test))
    elif test and test[0] == "CMD":
        out.append([str(c) for c in test[1:]])
    elif test and test[0] == "CMD-SHELL":
        out.append(shlex.split(" ".join(test[1:])))
    return out


# -------------------------------------------------------------- Dockerfile


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    base: str  # FROM argument, unexpanded
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str | None]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"{self.path.name}: no stage named {name!r}")

    def chain(self, build_args: dict[str, str] | None = None, target: str | None = None) -> tuple[list[Stage], str]:
        """The stages a build of `target` (default: the last) goes through,
        final first, and the external image at the bottom of the chain."""
        args = {k: v for k, v in self.global_args.items() if v is not None}
        args.update(build_args or {})
        stage = self.stage(target) if target else self.stages[-1]
        seen = []
        while True:
            seen.append(stage)
            image = expand(stage.base, args)
            named = [s for s in self.stages if s.name == image]
            if not named:
                return seen, image
            stage = named[0]


def expand(text: str, args: dict[str, str]) -> str:
    """Dockerfile ARG substitution: $NAME, ${NAME}, ${NAME:-default}."""

    def sub(m: re.Match) -> str:
        name = m.group(2) or m.group(5)
        op, default = m.group(3), m.group(4)
        value = args.get(name)
        if op in (":-", "-") and not value:
            return default or ""
        return value or ""

    return _INTERP.sub(sub, text)


def parse_dockerfile(path: Path) -> Dockerfile:
    logical: list[tuple[int, str]] = []
    buf, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue  # comments vanish, even inside a continued instruction
        if not buf:
            start = number
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        logical.append((start, buf))
        buf = ""
    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for number, text in logical:
        keyword, _, rest = text.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].lower() == "as" else None
            stages.append(Stage(words[0], name))
        elif keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            global_args[name.strip()] = default.strip().strip('"') if _ else None
        elif stages:
            stages[-1].instructions.append(Instruction(keyword, rest, number))
    return Dockerfile(path, global_args, stages)


def exec_form(args: str) -> list[str]:
    """CMD/ENTRYPOINT arguments as argv (JSON exec form or shell form)."""
    if args.startswith("["):
        return [str(a) for a in json.loads(args)]
    return ["/bin/sh", "-c", args]


@dataclass(frozen=True)
class Copy:
    sources: list[str]
    dest: str
    from_stage: str | None
    line: int


def copies(stage: Stage) -> list[Copy]:
    out = []
    for ins in stage.instructions:
        if ins.keyword not in ("COPY", "ADD"):
            continue
        words = json.loads(ins.args) if ins.args.startswith("[") else shlex.split(ins.args)
        flags = [w for w in words if w.startswith("--")]
        paths = [w for w in words if not w.startswith("--")]
        from_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
        out.append(Copy(paths[:-1], paths[-1], from_stage, ins.line))
    return out


_SEPARATORS = {"&&", "||", ";", "|", "&", ";;"}


def shell_commands(run_args: str) -> list[list[str]]:
    """A RUN line split into the argv of each simple command (at && || ; |),
    quotes respected."""
    lexer = shlex.shlex(run_args, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    out: list[list[str]] = [[]]
    for token in lexer:
        if token in _SEPARATORS:
            out.append([])
        else:
            out[-1].append(token)
    return [argv for argv in out if argv]


# ------------------------------------------------------------ .dockerignore


def _pattern_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
            continue
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.find("]", i)
            out += pattern[i : end + 1] if end > i else re.escape(c)
            i = end if end > i else i
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


@dataclass(frozen=True)
class DockerIgnore:
    patterns: list[tuple[bool, re.Pattern]]  # (is_exception, regex)

    @classmethod
    def read(cls, path: Path) -> DockerIgnore:
        patterns = []
        for line in path.read_text().splitlines() if path.exists() else []:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            line = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
            patterns.append((negate, _pattern_regex(line)))
        return cls(patterns)

    def excluded(self, path: str) -> bool:
        """Whether the build context leaves out path (relative, / separated):
        the last pattern matching it or one of its parent directories wins."""
        parts = Path(path).parts
        candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        result = False
        for negate, rx in self.patterns:
            if any(rx.match(c) for c in candidates):
                result = not negate
        return result


# ------------------------------------------------------- python commands


@dataclass(frozen=True)
class PythonCall:
    module: str | None  # python -m MODULE
    code: str | None  # python -c CODE


def python_calls(argv: list[str]) -> list[PythonCall]:
    """`python[3] -m X` and `python[3] -c CODE` found in an argv list."""
    out = []
    for i, word in enumerate(argv[:-2]):
        if re.fullmatch(r"(?:\S*/)?python(?:3(?:\.\d+)?)?", word):
            flag, value = argv[i + 1], argv[i + 2]
            if flag == "-m":
                out.append(PythonCall(value, None))
            elif flag == "-c":
                out.append(PythonCall(None, value))
    return out


def imported_modules(code: str) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for each import statement in code."""
    out = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, [alias.name for alias in node.names]))
    return out


# ------------------------------------------------------ tensor parallelism


def uneven_tp_splits(model: str, ranks: int) -> dict[str, int]:
    """The sizes of a built-in model that do not split over `ranks`
    tensor-parallel ranks (heads, KV heads, MLP width); fails for a model
    that is not built in, whose sizes these static checks cannot read."""
    from executor_svc.model.builtin import BUILTIN_MODELS  # torch: only for the tests that need it

    spec = BUILTIN_MODELS.get(model)
    assert spec is not None, f"{model!r} is not a built-in model ({sorted(BUILTIN_MODELS)}): its sizes are unknown here"
    sizes = {f: getattr(spec, f) for f in ("num_heads", "num_kv_heads", "intermediate_size")}
    return {f: v for f, v in sizes.items() if v % ranks}
