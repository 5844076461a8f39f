"""Small readers of the Markdown the docs tests check: fenced blocks marked
runnable, links, headings and the anchors they get."""

from __future__ import annotations

import re
from dataclasses import dataclass

# A block the page presents as runnable: the marker comment on the line
# right above the fence. `<!-- runnable: NAME -->` names a block that the
# test runs its own way (e.g. `make serve`, which runs in the foreground).
_RUNNABLE = re.compile(r"^<!-- runnable(?:: (?P<name>[\w-]+))? -->\n```(?P<lang>\w+)\n(?P<code>.*?)\n```$",
                       re.MULTILINE | re.DOTALL)
_FENCE = re.compile(r"^```.*?^```$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Block:
    name: str  # the marker's name, or "" for a block run as it is
    lang: str
    code: str
    line: int

    @property
    def id(self) -> str:
        first = next((ln for ln in self.code.splitlines() if ln.strip() and not ln.startswith("#")), "")
        words = re.sub(r"[^\w]+", "-", first).strip("-")[:40]
        return f"{self.lang}-{words}"


def runnable_blocks(text: str) -> list[Block]:
    return [Block(m.group("name") or "", m.group("lang"), m.group("code"), text.count("\n", 0, m.start()) + 1)
            for m in _RUNNABLE.finditer(text)]


def without_code(text: str) -> str:
    """text with fenced blocks blanked out (links and headings in code are not)."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def links(text: str) -> list[str]:
    return [m.group("target") for m in _LINK.finditer(without_code(text))]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation
    dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in _HEADING.finditer(without_code(text)):
        base = github_anchor(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out
