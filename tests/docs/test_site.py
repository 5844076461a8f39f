"""The documentation site builds offline with no warning (mkdocs --strict
turns a broken link or anchor, or a page missing from the nav, into a
failure), and every measured figure has one home: docs/performance.md."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PERFORMANCE = DOCS / "performance.md"
# Material prints a banner about its end of life on every build; it is not
# a build warning, and this turns it off. `make docs` sets it too.
QUIET = {"NO_MKDOCS_2_WARNING": "1"}
# What a measured figure looks like: a ratio (5.33x), a share (97.5%), a
# rate or a time with decimals or thousands (1,951.2 tok/s, 0.840 ms).
FIGURE = re.compile(r"\b\d[\d,]*(?:\.\d+)?x\b|\b\d+(?:\.\d+)?%|\b\d[\d,]*(?:\.\d+)? ?(?:tok/s|ms|µs|MiB|req/s)\b")
# Values the pattern finds that are settings or thresholds, not measurements.
NOT_FIGURES = {
    "20 ms": "INLINE_DECODE_MAX_S: decode steps shorter than this run on the executor's event loop",
}


def test_mkdocs_build_strict_passes_with_no_warning(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, env={**os.environ, **QUIET}, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{output[-4000:]}"
    assert "WARNING" not in output, output[-4000:]
    assert (tmp_path / "site" / "index.html").exists()


def test_every_page_in_docs_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert pages, "no pages under docs/"
    missing = [p for p in pages if f": {p}" not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"


def figures(text: str) -> set[str]:
    return {m.group(0) for m in FIGURE.finditer(text)} - set(NOT_FIGURES)


def test_no_figure_on_the_performance_page_appears_elsewhere():
    """The README and the other pages link to the performance page for a
    figure instead of repeating it, so that it has one copy to update."""
    measured = figures(PERFORMANCE.read_text())
    assert len(measured) > 50, sorted(measured)  # the pattern still finds the page's figures
    others = [REPO / "README.md", *(p for p in DOCS.rglob("*.md") if p != PERFORMANCE)]
    repeated = {str(p.relative_to(REPO)): sorted(figures(p.read_text()) & measured) for p in others}
    repeated = {page: found for page, found in repeated.items() if found}
    assert not repeated, f"figures from docs/performance.md repeated elsewhere: {repeated}"
