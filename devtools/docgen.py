"""Renders the reference parts of the documentation from the code, so that
they cannot drift from it:

- docs/configuration.md: every SCHEDULER_*, EXECUTOR_* and GATEWAY_* setting
  (name, type, default, description) from the pydantic-settings classes;
- docs/grpc-api.md: the public API from the comments in
  protos/llmsched/v1/scheduler.proto;
- docs/capacity-planning.md: the simulator's shipped roofline profiles
  (simulator/roofline.py).

The pages are hand-written prose around regions that start with
`<!-- generated: NAME -->` and end with `<!-- end generated: NAME -->`; only
those regions are rewritten. tests/docs fails when a committed page differs
from what this renders.

Run: python -m devtools.docgen           (make docs-gen: rewrites the pages)
     python -m devtools.docgen --check   (exit 1 when a page is stale)

Nothing here imports torch: the settings modules and the simulator are
torch-free.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import tempfile
import typing
from collections.abc import Callable, Iterable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = REPO_ROOT / "docs"
CONFIG_PAGE = DOCS / "configuration.md"
API_PAGE = DOCS / "grpc-api.md"
CAPACITY_PAGE = DOCS / "capacity-planning.md"
PUBLIC_PROTO = "llmsched/v1/scheduler.proto"  # under protos/
REGENERATE = "python -m devtools.docgen (make docs-gen)"

# (region name, module, class): one table per settings class, in this order.
SETTINGS_CLASSES = [
    ("scheduler-settings", "scheduler_svc.config", "SchedulerSettings"),
    ("executor-settings", "executor_svc.config", "ExecutorSettings"),
    ("gateway-settings", "gateway_svc.config", "GatewaySettings"),
]

_REGION = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated: (?P=name) -->)",
                     re.DOTALL)


# --- settings ----------------------------------------------------------------

def settings_class(module: str, name: str) -> type:
    return getattr(importlib.import_module(module), name)


def env_name(cls: type, field: str) -> str:
    return f"{cls.model_config.get('env_prefix', '')}{field.upper()}"


def _bounds(metadata: Iterable[object]) -> str:
    """`0–65535`, `≥ 1`, `> 0` from annotated_types constraints."""
    # annotated_types' Ge, Gt, Le and Lt each hold their bound in a field
    # named like the class, lower-cased.
    found = {k: getattr(m, k.lower()) for m in metadata if (k := type(m).__name__) in ("Ge", "Gt", "Le", "Lt")}
    if "Ge" in found and "Le" in found:
        return f"{found['Ge']}–{found['Le']}"
    parts = [f"{sym} {found[k]}" for k, sym in (("Ge", "≥"), ("Gt", ">"), ("Le", "≤"), ("Lt", "<")) if k in found]
    return ", ".join(parts)


def type_label(field) -> str:
    annotation = field.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(f"`{v}`" if v != "" else "empty" for v in typing.get_args(annotation))
    label = getattr(annotation, "__name__", str(annotation))
    bounds = _bounds(field.metadata)
    return f"{label} ({bounds})" if bounds else label


def default_label(value: object) -> str:
    if value == "":
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def settings_table(cls: type) -> str:
    rows = ["| variable | type | default | description |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        rows.append(f"| `{env_name(cls, name)}` | {type_label(field)} | {default_label(field.default)} | "
                    f"{_cell(field.description or '')} |")
    return "\n".join(rows) + "\n"


def missing_descriptions(classes: Iterable[type]) -> list[str]:
    return [env_name(cls, name) for cls in classes for name, f in cls.model_fields.items()
            if not (f.description or "").strip()]


# --- the public gRPC API --------------------------------------------------------

# FileDescriptorProto field numbers, as SourceCodeInfo paths use them.
_MESSAGE, _ENUM, _SERVICE, _SYNTAX = 4, 5, 6, 12
_FIELD, _METHOD, _ENUM_VALUE = 2, 2, 2

_SCALARS = {
    1: "double", 2: "float", 3: "int64", 4: "uint64", 5: "int32", 6: "fixed64", 7: "fixed32", 8: "bool",
    9: "string", 12: "bytes", 13: "uint32", 15: "sfixed32", 16: "sfixed64", 17: "sint32", 18: "sint64",
}


def proto_descriptor(proto: str = PUBLIC_PROTO):
    """The FileDescriptorProto of protos/<proto>, with its comments."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc  # the test extra, as for devtools.genproto

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        code = protoc.main(["protoc", f"-I{REPO_ROOT / 'protos'}", "--include_source_info",
                            f"--descriptor_set_out={out}", proto])
        if code != 0:
            raise RuntimeError(f"protoc failed on {proto} with exit code {code}")
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (file,) = fds.file
    return file


def _comments(file) -> dict[tuple[int, ...], tuple[str, int]]:
    """path -> (comment text, first line of the element)."""
    out = {}
    for loc in file.source_code_info.location:
        text = "\n".join(c for c in (loc.leading_comments, loc.trailing_comments) if c.strip())
        out[tuple(loc.path)] = (" ".join(text.split()), loc.span[0])
    return out


def _anchor(name: str) -> str:
    return name.lower()


def _type_name(field, package: str, map_entries: dict | None = None) -> str:
    entry = (map_entries or {}).get(field.type_name.rsplit(".", 1)[-1]) if field.type_name else None
    if entry is not None:  # a map<K, V> field: protoc's nested XEntry message has no section of its own
        key, value = (_type_name(f, package) for f in entry.field)
        if value.startswith("`"):
            return f"`map<{key.strip('`')}, {value.strip('`')}>`"
        return f"`map<{key.strip('`')}, ` {value} `>`"
    if field.type_name:  # message or enum: link to its section
        short = field.type_name.removeprefix(f".{package}.")
        label = f"[`{short}`](#{_anchor(short)})"
    else:
        label = f"`{_SCALARS[field.type]}`"
    if field.label == field.LABEL_REPEATED:
        return f"repeated {label}"
    if field.proto3_optional:
        return f"optional {label}"
    return label


def api_reference(file) -> str:
    notes = _comments(file)
    package = file.package
    lines: list[str] = []
    header = notes.get((_SYNTAX,), ("", 0))[0]
    if header:
        lines += [f"`{file.name}` (package `{package}`): {header}", ""]
    for s, service in enumerate(file.service):
        lines += [f"### {service.name}", "", notes.get((_SERVICE, s), ("", 0))[0], "",
                  "| method | request | response | description |", "|---|---|---|---|"]
        for m, method in enumerate(service.method):
            request = method.input_type.removeprefix(f".{package}.")
            response = method.output_type.removeprefix(f".{package}.")
            stream = "stream " if method.server_streaming else ""
            lines.append(f"| `{method.name}` | [`{request}`](#{_anchor(request)}) | "
                         f"{stream}[`{response}`](#{_anchor(response)}) | "
                         f"{_cell(notes.get((_SERVICE, s, _METHOD, m), ('', 0))[0])} |")
        lines.append("")
    # Messages and enums in the order the file declares them.
    kinds = [(notes.get((_MESSAGE, i), ("", 0))[1], "message", i, msg) for i, msg in enumerate(file.message_type)]
    kinds += [(notes.get((_ENUM, i), ("", 0))[1], "enum", i, enum) for i, enum in enumerate(file.enum_type)]
    for _, kind, i, desc in sorted(kinds, key=lambda k: k[0]):
        top = (_MESSAGE, i) if kind == "message" else (_ENUM, i)
        lines += [f"### {desc.name}", ""]
        comment = notes.get(top, ("", 0))[0]
        if comment:
            lines += [comment, ""]
        if kind == "message":
            if not desc.field:
                lines += ["No fields.", ""]
                continue
            lines += ["| field | number | type | description |", "|---|---|---|---|"]
            map_entries = {nested.name: nested for nested in desc.nested_type if nested.options.map_entry}
            for f, field in enumerate(desc.field):
                lines.append(f"| `{field.name}` | {field.number} | {_type_name(field, package, map_entries)} | "
                             f"{_cell(notes.get((*top, _FIELD, f), ('', 0))[0])} |")
        else:
            lines += ["| value | number | description |", "|---|---|---|"]
            for v, value in enumerate(desc.value):
                lines.append(f"| `{value.name}` | {value.number} | "
                             f"{_cell(notes.get((*top, _ENUM_VALUE, v), ('', 0))[0])} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


# --- pages ------------------------------------------------------------------------

def regions(classes: list[tuple[str, type]] | None = None, proto_file=None) -> dict[str, Callable[[], str]]:
    """Region name -> renderer. classes and proto_file replace the real
    ones (tests use this to show that a new setting makes a page stale)."""
    if classes is None:
        classes = [(name, settings_class(module, cls)) for name, module, cls in SETTINGS_CLASSES]
    out: dict[str, Callable[[], str]] = {name: (lambda c=cls: settings_table(c)) for name, cls in classes}
    out["grpc-api"] = lambda: api_reference(proto_file if proto_file is not None else proto_descriptor())
    out["roofline-profiles"] = _roofline_profiles
    return out


def _roofline_profiles() -> str:
    from simulator.roofline import profiles_table

    return profiles_table()


def render(text: str, renderers: dict[str, Callable[[], str]]) -> str:
    """text with every generated region it has rewritten; a region with no
    renderer is an error, so a typo cannot freeze a region."""
    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name not in renderers:
            raise KeyError(f"no renderer for generated region {name!r}; known: {sorted(renderers)}")
        return m.group(1) + renderers[name]() + m.group(4)

    return _REGION.sub(fill, text)


def region_names(text: str) -> list[str]:
    return [m.group("name") for m in _REGION.finditer(text)]


PAGES = (CONFIG_PAGE, API_PAGE, CAPACITY_PAGE)


def stale_pages(renderers: dict[str, Callable[[], str]] | None = None) -> list[Path]:
    renderers = renderers or regions()
    return [page for page in PAGES if render(page.read_text(), renderers) != page.read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.docgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a page is stale; write nothing")
    args = parser.parse_args(argv)
    renderers = regions()
    stale = []
    for page in PAGES:
        old = page.read_text()
        new = render(old, renderers)
        if new != old:
            stale.append(page)
            if not args.check:
                page.write_text(new)
    rel = [str(p.relative_to(REPO_ROOT)) for p in stale]
    if args.check:
        if stale:
            print(f"stale: {', '.join(rel)}; run {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    print(f"rewrote {', '.join(rel)}" if rel else "the generated pages are current", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
