"""Text that is still arriving: how much of its end may yet become a
marker (`<tool_call>`, `</think>`, ...) and must be held back."""

from __future__ import annotations


def held_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of
    `marker`: `held_prefix_len("ab <tool", "<tool_call>") == 5`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
