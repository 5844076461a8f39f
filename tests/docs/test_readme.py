"""README.md is the front door: short, every link in it resolves, and its
quick-start commands are the ones the getting-started test runs."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

from tests.docs.markdown import anchors, links, runnable_blocks

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
FENCED = re.compile(r"^```(?P<lang>\w+)\n(?P<code>.*?)\n```$", re.MULTILINE | re.DOTALL)


def test_readme_is_under_250_lines():
    n = len(README.read_text().splitlines())
    assert n < 250, f"README.md has {n} lines; move detail into docs/"


def test_every_relative_link_in_the_readme_resolves():
    targets = links(README.read_text())
    assert len(targets) >= 15, targets
    broken = []
    for target in targets:
        if re.match(r"[a-z][a-z+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (README.parent / unquote(path)).resolve() if path else README
        if not file.is_relative_to(REPO) or not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file.read_text())):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(REPO)}")
    assert not broken, "README.md links that do not resolve:\n" + "\n".join(broken)


def test_the_readme_quick_starts_are_the_tested_getting_started_blocks():
    tested = {b.code for b in runnable_blocks((REPO / "docs" / "getting-started.md").read_text())}
    quick = [m.group("code") for m in FENCED.finditer(README.read_text())
             if m.group("lang") in ("sh", "python") and "localhost:" in m.group("code")]
    assert len(quick) >= 3, quick
    untested = [code for code in quick if code not in tested]
    assert not untested, f"README.md blocks that docs/getting-started.md does not run: {untested}"
