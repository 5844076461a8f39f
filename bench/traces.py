"""Production request traces (assets/README.md), read in place:
the Azure LLM inference CSV (arrival times and lengths) and the Mooncake
JSONL (arrival times, lengths and prefix-block ids). The same readers drive
`python -m bench --workload trace` against the real services and
`python -m simulator run` in virtual time, so both replay the same
requests, token for token.

Options, applied in this order:

- a time window `[start_s, end_s)` in seconds from the trace's first
  arrival; arrivals are then counted from the window's start;
- a rate scale: arrivals come `rate_scale` times as fast (offsets divided
  by it), the same requests in the same order;
- a length scale: prompt and output lengths, and Mooncake's 512-token prefix
  blocks, multiplied by it (rounded, at least 1);
- a clamp to the model's context: a request whose prompt + output exceeds
  `max_model_len` keeps the ratio of the two, shrunk to fit (at least one
  token each). Shortening a prompt keeps its start, so shared prefixes stay
  shared.

Neither trace holds text. An Azure prompt is random token ids that start
with a few drawn for that request alone, so no two requests share a KV
block (the prefix cache never hits by accident). A Mooncake `hash_id` maps
to a fixed block of token ids, the same wherever it appears, so requests
that share ids share a real, cacheable prefix.

Everything is seeded: the same file, options and seed give the same
requests. Kept free of numpy, like the rest of the bench client.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from bench.workloads import FIRST_REGULAR_ID, BenchRequest, Workload

# Tokens per Mooncake hash_id before scaling (the trace's block).
MOONCAKE_BLOCK_TOKENS = 512
# An Azure prompt's first tokens, drawn for that request alone: with a
# vocabulary of 512, two requests share them with probability 512^-8.
UNIQUE_HEAD_TOKENS = 8
FORMATS = ("azure", "mooncake")


@dataclass(frozen=True, slots=True)
class TraceOptions:
    window: tuple[float, float | None] = (0.0, None)  # seconds from the first arrival; None = to the end
    rate_scale: float = 1.0
    length_scale: float = 1.0
    max_model_len: int | None = None  # clamp prompt + output to this; None = no clamp
    max_requests: int | None = None
    seed: int = 0

    def __post_init__(self):
        start, end = self.window
        if start < 0 or (end is not None and end <= start):
            raise ValueError(f"trace window must satisfy 0 <= start < end, got {self.window}")
        if not self.rate_scale > 0 or not self.length_scale > 0:
            raise ValueError(f"rate and length scales must be positive, got {self.rate_scale}, {self.length_scale}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2 to hold a prompt and an output token")

    def as_dict(self) -> dict:
        return {"window_s": list(self.window), "rate_scale": self.rate_scale, "length_scale": self.length_scale,
                "max_model_len": self.max_model_len, "max_requests": self.max_requests, "seed": self.seed}


@dataclass(slots=True)
class TraceRecord:
    """One request of a trace after the options, without its token ids yet
    (a full-hour trace holds tens of millions of prompt tokens; the
    simulator builds each prompt when the request arrives)."""

    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    # Mooncake: one id per block of `block_tokens` prompt tokens.
    hash_ids: tuple[int, ...] | None = None
    block_tokens: int = 0


@dataclass(slots=True)
class Trace:
    path: str
    format: str
    options: TraceOptions
    records: list[TraceRecord]
    num_clamped: int

    def params(self) -> dict:
        """The workload parameters a report records."""
        return {"path": self.path, "format": self.format, **self.options.as_dict(),
                "num_requests": len(self.records), "num_clamped": self.num_clamped}


def detect_format(path: Path) -> str:
    if path.suffix == ".csv":
        return "azure"
    if path.suffix in (".jsonl", ".json"):
        return "mooncake"
    raise ValueError(f"{path}: cannot tell the trace format from the suffix; expected .csv (Azure) or .jsonl "
                     "(Mooncake)")


def _azure_rows(path: Path) -> list[tuple[float, int, int, None]]:
    rows = []
    t0 = None
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: not an Azure trace, missing columns {sorted(missing)}")
        for lineno, row in enumerate(reader, start=2):
            try:
                t = _azure_time(row["TIMESTAMP"])
                prompt, output = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
            t0 = t if t0 is None else t0
            # Whole microseconds: exact, where epoch floats would round.
            rows.append(((t - t0) // timedelta(microseconds=1) / 1e6, prompt, output, None))
    return rows


def _azure_time(text: str) -> datetime:
    # "2023-11-16 18:15:46.6805900": seven fractional digits, one more than
    # datetime parses; the tenth of a microsecond is dropped.
    head, _, frac = text.strip().partition(".")
    dt = datetime.strptime(head, "%Y-%m-%d %H:%M:%S")
    return dt + timedelta(microseconds=int(frac[:6].ljust(6, "0"))) if frac else dt


def _mooncake_rows(path: Path) -> list[tuple[float, int, int, tuple[int, ...]]]:
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                rows.append((obj["timestamp"] / 1000.0, int(obj["input_length"]), int(obj["output_length"]),
                             tuple(int(h) for h in obj["hash_ids"])))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake record ({exc})") from None
    return rows


def _clamp(prompt: int, output: int, max_len: int | None) -> tuple[int, int, bool]:
    if max_len is None or prompt + output <= max_len:
        return prompt, output, False
    p = max(1, min(max_len - 1, prompt * max_len // (prompt + output)))
    return p, max(1, max_len - p), True


def read_trace(path: str | Path, options: TraceOptions = TraceOptions(), fmt: str | None = None) -> Trace:
    path = Path(path)
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    rows = _azure_rows(path) if fmt == "azure" else _mooncake_rows(path)
    rows.sort(key=lambda r: r[0])  # stable: equal times keep file order
    start, end = options.window
    block_tokens = max(1, round(MOONCAKE_BLOCK_TOKENS * options.length_scale))
    records, clamped = [], 0
    for t, prompt, output, hash_ids in rows:
        if t < start or (end is not None and t >= end):
            continue
        if options.max_requests is not None and len(records) >= options.max_requests:
            break
        p = max(1, round(prompt * options.length_scale))
        o = max(1, round(output * options.length_scale))
        p, o, was_clamped = _clamp(p, o, options.max_model_len)
        clamped += was_clamped
        if hash_ids is not None:
            hash_ids = hash_ids[: -(-p // block_tokens)]
        records.append(TraceRecord(len(records), (t - start) / options.rate_scale, p, o, hash_ids,
                                   block_tokens if hash_ids is not None else 0))
    if not records:
        raise ValueError(f"{path}: no requests in the window {options.window}")
    return Trace(str(path), fmt, options, records, clamped)


class PromptMaker:
    """Token ids for a trace's prompts, deterministic in (seed, record): a
    record's prompt is the same whichever other records were built first."""

    def __init__(self, vocab_size: int, seed: int, max_len: int):
        if vocab_size <= FIRST_REGULAR_ID:
            raise ValueError(f"vocab_size {vocab_size} leaves no regular token ids")
        self.vocab_size = vocab_size
        self.seed = seed
        rng = random.Random(f"trace-pool:{seed}")
        # Azure prompts are a unique head plus a slice of this pool.
        self._pool = [rng.randrange(FIRST_REGULAR_ID, vocab_size) for _ in range(max(1, max_len))]
        self._blocks: dict[tuple[int, int], list[int]] = {}

    def _block(self, hash_id: int, n: int) -> list[int]:
        key = (hash_id, n)
        block = self._blocks.get(key)
        if block is None:
            rng = random.Random(f"trace-block:{self.seed}:{hash_id}")
            block = [rng.randrange(FIRST_REGULAR_ID, self.vocab_size) for _ in range(n)]
            self._blocks[key] = block
        return block

    def prompt(self, rec: TraceRecord) -> list[int]:
        if rec.hash_ids is not None:
            ids: list[int] = []
            for h in rec.hash_ids:
                ids += self._block(h, rec.block_tokens)
            # A prompt longer than its blocks (not in the published trace)
            # is filled from its last block's successors, still shared.
            h = rec.hash_ids[-1] if rec.hash_ids else -1
            while len(ids) < rec.prompt_len:
                h = -h - 2
                ids += self._block(h, rec.block_tokens)
            return ids[: rec.prompt_len]
        rng = random.Random(f"trace-request:{self.seed}:{rec.index}")
        head = [rng.randrange(FIRST_REGULAR_ID, self.vocab_size) for _ in range(min(UNIQUE_HEAD_TOKENS, rec.prompt_len))]
        rest = rec.prompt_len - len(head)
        if rest <= 0:
            return head
        pool = self._pool
        if rest > len(pool):
            return head + (pool * (rest // len(pool) + 1))[:rest]
        offset = rng.randrange(0, len(pool) - rest + 1)
        return head + pool[offset: offset + rest]


def trace_workload(trace: Trace, vocab_size: int) -> Workload:
    """The trace as bench requests with their token ids (for the real
    services: a slice, not a full hour)."""
    maker = PromptMaker(vocab_size, trace.options.seed, max((r.prompt_len for r in trace.records), default=1))
    requests = [BenchRequest(r.index, r.output_len, prompt_token_ids=maker.prompt(r), arrival_s=r.arrival_s)
                for r in trace.records]
    return Workload("trace", requests, {**trace.params(), "vocab_size": vocab_size})


def mean_rate(trace: Trace) -> float:
    """Requests per second over the window: count over the last arrival."""
    last = max(r.arrival_s for r in trace.records)
    return len(trace.records) / last if last > 0 else float("inf")


def parse_window(text: str) -> tuple[float, float | None]:
    """`START:END` in seconds (END may be empty: to the trace's end)."""
    start, sep, end = text.partition(":")
    if not sep:
        raise ValueError(f"trace window {text!r}: expected START:END in seconds, e.g. 600:900 or 600:")
    return float(start or 0), (float(end) if end else None)
