"""The documentation site builds offline with no warning (mkdocs --strict
turns a broken link or anchor, or a page missing from the nav, into a
failure), and every measured figure has one home: docs/performance.md
(the README's headline table repeats some, checked against it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.docs.markdown import github_anchor

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PERFORMANCE = DOCS / "performance.md"
README = REPO / "README.md"
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


def sections(text: str) -> dict[str, str]:
    """The page's `##` sections by their anchor (as mkdocs and GitHub make
    it), each with its text up to the next `##` heading."""
    out: dict[str, str] = {}
    for part in re.split(r"^(?=## )", text, flags=re.MULTILINE):
        if part.startswith("## "):
            heading, _, body = part.partition("\n")
            out[github_anchor(heading[3:])] = body
    return out


def headline_rows(readme: str) -> list[str]:
    """The table rows of the README's "Headline figures" section."""
    section = sections(readme).get("headline-figures", "")
    return [line for line in section.splitlines() if line.startswith("|") and not line.startswith("|---")]


PERFORMANCE_LINK = re.compile(r"\]\(docs/performance\.md#(?P<anchor>[\w-]+)\)")


def test_the_readme_headline_figures_are_the_performance_page_s():
    """Each figure in the README's headline table links to its section of
    docs/performance.md and appears there verbatim, so that a figure
    re-measured on that page and left stale in the README fails here."""
    performance = sections(PERFORMANCE.read_text())
    rows = headline_rows(README.read_text())
    assert len(rows) > 3, f"README.md has no Headline figures table: {rows}"
    problems = []
    for row in rows[1:]:  # the first row is the header
        links = [m.group("anchor") for m in PERFORMANCE_LINK.finditer(row)]
        shown = figures(row)
        if not links:
            problems.append(f"no link to a section of docs/performance.md: {row}")
            continue
        if not shown:
            problems.append(f"a link without its figure (show the number): {row}")
            continue
        for anchor in links:
            if anchor not in performance:
                problems.append(f"docs/performance.md has no section #{anchor}: {row}")
                continue
            stale = sorted(shown - figures(performance[anchor]))
            if stale:
                problems.append(f"{stale} not in docs/performance.md#{anchor} (stale or mistyped?): {row}")
    assert not problems, "README.md's Headline figures disagree with docs/performance.md:\n" + "\n".join(problems)


def test_no_figure_on_the_performance_page_appears_elsewhere():
    """Other pages link to the performance page for a figure instead of
    repeating it, so that it has one copy to update. The README repeats the
    headline ones in its Headline figures table, checked against the page
    by the test above, and nowhere else."""
    measured = figures(PERFORMANCE.read_text())
    assert len(measured) > 50, sorted(measured)  # the pattern still finds the page's figures
    readme = README.read_text()
    readme_elsewhere = readme
    for row in headline_rows(readme):
        readme_elsewhere = readme_elsewhere.replace(row, "")
    others = {README: readme_elsewhere, **{p: p.read_text() for p in DOCS.rglob("*.md") if p != PERFORMANCE}}
    repeated = {str(p.relative_to(REPO)): sorted(figures(text) & measured) for p, text in others.items()}
    repeated = {page: found for page, found in repeated.items() if found}
    assert not repeated, ("figures from docs/performance.md repeated elsewhere (link to the page instead; the "
                          f"README may show them only in its Headline figures table): {repeated}")
