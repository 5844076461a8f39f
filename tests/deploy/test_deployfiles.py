"""The readers in deployfiles.py follow Docker's rules where test_compose.py
relies on them."""

from __future__ import annotations

import pytest

from tests.deploy.deployfiles import (
    DockerIgnore,
    PortMapping,
    Reset,
    interpolate,
    merge,
    parse_dockerfile,
    port_mappings,
    python_calls,
    shell_commands,
)


def test_interpolation_uses_defaults_and_keeps_escaped_dollars():
    assert interpolate("${A:-x}/${B-y}/${C}/$$D") == "x/y//$D"
    assert interpolate("${A:-x}", {"A": ""}) == "x"
    assert interpolate("${A-x}", {"A": ""}) == ""
    assert interpolate("${A:-x}", {"A": "set"}) == "set"
    with pytest.raises(KeyError):
        interpolate("${A:?needed}")


def test_override_merge_resets_and_unions_like_compose():
    base = {"deploy": {"devices": [1]}, "ports": ["1:1"], "env": {"A": "1"}, "command": ["a"]}
    over = {"deploy": {"devices": Reset([])}, "ports": ["2:2"], "env": {"B": "2"}, "command": ["b"]}
    assert merge(base, over) == {"deploy": {"devices": []}, "ports": ["1:1", "2:2"], "env": {"A": "1", "B": "2"}, "command": ["b"]}


def test_port_mappings_parse_short_and_long_syntax():
    svc = {"ports": ["50051:50051", "127.0.0.1:8000:8000/tcp", "9000", {"target": 1, "published": "2"}]}
    assert port_mappings(svc) == [
        PortMapping(None, 50051, 50051), PortMapping("127.0.0.1", 8000, 8000), PortMapping(None, None, 9000), PortMapping(None, 2, 1),
    ]


def test_dockerignore_allowlist_with_exceptions(tmp_path):
    path = tmp_path / ".dockerignore"
    path.write_text("*\n!src\n!docker/keep.py\n**/__pycache__\n")
    ignore = DockerIgnore.read(path)
    assert ignore.excluded(".venv/bin/python")
    assert not ignore.excluded("src/a/b.py")
    assert ignore.excluded("src/a/__pycache__/b.pyc")
    assert not ignore.excluded("docker/keep.py")
    assert ignore.excluded("docker/other.py")


def test_shell_commands_respect_quotes():
    run = """cd /x && python3 -c "import a; b()" > out.txt; pip install 'y[z]' || true"""
    assert shell_commands(run) == [["cd", "/x"], ["python3", "-c", "import a; b()", ">", "out.txt"], ["pip", "install", "y[z]"], ["true"]]
    assert python_calls(["python3", "-c", "import a; b()", ">", "out.txt"])[0].code == "import a; b()"


def test_dockerfile_chain_follows_stage_args(tmp_path):
    path = tmp_path / "Dockerfile"
    path.write_text(
        "ARG FLAVOR=one\nARG IMG=base:1\n# comment\nFROM ${IMG} AS x-one\nRUN a \\\n  # gone\n  && b\n"
        "FROM python:3.11 AS x-two\nFROM x-${FLAVOR} AS final\nCMD [\"python3\", \"-m\", \"m\"]\n"
    )
    df = parse_dockerfile(path)
    stages, image = df.chain()
    assert [s.name for s in stages] == ["final", "x-one"] and image == "base:1"
    assert shell_commands(df.stage("x-one").instructions[0].args) == [["a"], ["b"]]
    assert df.chain({"FLAVOR": "two"})[1] == "python:3.11"
