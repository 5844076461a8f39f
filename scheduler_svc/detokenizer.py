"""Incremental detokenization and stop strings.

Decoding each new token on its own breaks on two things: tokenizers that
drop or add a leading space depending on context (SentencePiece), and
characters split over several byte tokens. So each step decodes a short
window that starts a few tokens back (prefix) and emits only what the new
tokens added; while the text ends in an incomplete character (U+FFFD) it
waits for more tokens.
"""

from __future__ import annotations

from tokenizers import Tokenizer

# Tokens of context kept before the first generated token.
INITIAL_WINDOW = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-INITIAL_WINDOW:])
        self.prefix_offset = 0  # start of the decoding window in self.ids
        self.read_offset = len(self.ids)  # tokens before this are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Returns the text the new tokens complete; may be empty."""
        self.ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of generation: whatever is left, even an incomplete
        character (as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        # Drop what the window no longer needs, so memory stays bounded.
        if self.prefix_offset > 0:
            del self.ids[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        return delta


class StopStringMatcher:
    """Holds back just enough text to see a stop string that spans
    several deltas; the stop string itself is never released."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""
        self.matched: str | None = None  # the stop string that was hit

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to release, whether a stop string was hit)."""
        if not self.stop:
            return text, False
        self.pending += text
        hits = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stop) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            out, self.pending = self.pending[:at], ""
            return out, True
        cut = max(0, len(self.pending) - self.holdback)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def token_text_decoder(tokenizer: Tokenizer):
    """Returns a function giving one token's text as it reads mid-sequence,
    for logprob entries. SentencePiece drops the leading space of a text's
    first token, so each token is decoded after an anchor token whose text
    is then cut off."""
    anchor = tokenizer.encode("a", add_special_tokens=False).ids[:1]
    anchor_text = tokenizer.decode(anchor, skip_special_tokens=False)

    def decode(token_id: int) -> str:
        text = tokenizer.decode([*anchor, token_id], skip_special_tokens=False)
        if anchor and text.startswith(anchor_text):
            return text[len(anchor_text):]
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return decode
