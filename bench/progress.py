"""Live progress on stderr: requests done, output tokens/s, errors.

tqdm when it is installed (it comes with transformers), else one line
rewritten with a carriage return. Never on stdout, which carries the
summary table that people paste.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Progress:
    total: int
    desc: str = "bench"
    enabled: bool = True
    done: int = 0
    errors: int = 0
    output_tokens: int = 0
    _start: float = field(default_factory=time.perf_counter)
    _bar: object = None
    _last_line: float = 0.0

    def __post_init__(self):
        if not self.enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=self.total, desc=self.desc, unit="req", file=sys.stderr, dynamic_ncols=True)

    def add_tokens(self, n: int) -> None:
        self.output_tokens += n

    def request_done(self, ok: bool) -> None:
        self.done += 1
        self.errors += not ok
        if self._bar is not None:
            self._bar.update(1)
        self.refresh()

    def refresh(self) -> None:
        """Redraws the rate; also called on a timer so tok/s moves while
        long requests are still running and none completes."""
        if not self.enabled:
            return
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        rate = self.output_tokens / elapsed
        if self._bar is not None:
            self._bar.set_postfix_str(f"out {rate:,.0f} tok/s, errors {self.errors}", refresh=True)
            return
        now = time.perf_counter()
        if now - self._last_line < 0.2 and self.done < self.total:
            return  # a carriage-return line redrawn per token would flood slow terminals
        self._last_line = now
        sys.stderr.write(f"\r{self.desc}: {self.done}/{self.total} requests, {rate:,.0f} out tok/s, "
                         f"{self.errors} errors, {elapsed:.1f}s ")
        sys.stderr.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self.refresh()
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()
