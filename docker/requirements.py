"""Reads the dependency lists out of pyproject.toml for the image builds.

The Dockerfiles install the dependencies first, from pyproject.toml alone,
and the project's own code after, with `pip install --no-deps`: editing a
.py file then rebuilds only the last layer, not grpcio or torch. Only the
standard library is used: it runs before anything is installed.

    requirements.py                          base dependencies (the scheduler)
    requirements.py --extra executor --exclude torch
                                             base + executor extra, minus torch
                                             (the image already has torch)
    requirements.py --extra executor --only torch
                                             the pinned torch requirement
    requirements.py --check-installed torch  fails unless the installed torch
                                             is the version pyproject pins
    requirements.py --pin-installed torch triton
                                             NAME==VERSION of what is
                                             installed, for `pip -c`, so pip
                                             never swaps the image's torch
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

# Beside this script inside an image build; the repository root otherwise.
_HERE = Path(__file__).resolve().parent
PYPROJECT_CANDIDATES = (_HERE / "pyproject.toml", _HERE.parent / "pyproject.toml")
_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_PIN = re.compile(r"===?\s*([^,;\s]+)")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = _NAME.match(requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return normalize(match.group(1))


def pinned_version(requirement: str) -> str | None:
    match = _PIN.search(requirement.split(";")[0])
    return match.group(1) if match else None


def requirements(pyproject: Path, extras: list[str], exclude: list[str], only: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"{pyproject}: no optional-dependencies group {extra!r}")
        reqs += optional[extra]
    drop = {normalize(n) for n in exclude}
    keep = {normalize(n) for n in only}
    out = [r for r in reqs if requirement_name(r) not in drop and (not keep or requirement_name(r) in keep)]
    missing = keep - {requirement_name(r) for r in out}
    if missing:
        raise SystemExit(f"{pyproject}: no requirement named {sorted(missing)}")
    return out


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pyproject", type=Path, default=None)
    parser.add_argument("--extra", action="append", default=[])
    parser.add_argument("--exclude", action="append", default=[])
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--check-installed", metavar="NAME")
    parser.add_argument("--pin-installed", nargs="+", metavar="NAME")
    args = parser.parse_args(argv)
    pyproject = args.pyproject or next((p for p in PYPROJECT_CANDIDATES if p.exists()), PYPROJECT_CANDIDATES[-1])

    if args.pin_installed:
        for name in args.pin_installed:
            version = installed_version(name)
            if version is not None:
                print(f"{name}=={version}")
        return 0

    if args.check_installed:
        name = args.check_installed
        project = tomllib.loads(pyproject.read_text())["project"]
        every = list(project.get("dependencies", []))
        for group in project.get("optional-dependencies", {}).values():
            every += group
        pins = {pinned_version(r) for r in every if requirement_name(r) == normalize(name)} - {None}
        have = installed_version(name)
        if have is None:
            print(f"{name} is not installed in this image", file=sys.stderr)
            return 1
        # A local version label (+cu126, +cpu) names the build, not the release.
        if pins and have.split("+")[0] not in pins:
            print(f"{name} {have} is installed but pyproject.toml pins {sorted(pins)}: "
                  f"pick a base image with that {name}", file=sys.stderr)
            return 1
        print(f"{name} {have} matches pyproject.toml")
        return 0

    print("\n".join(requirements(pyproject, args.extra, args.exclude, args.only)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
