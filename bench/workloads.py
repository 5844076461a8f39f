"""Seeded, reproducible workloads (docs/performance.md): mixed,
shared-prefix, overload, multi-turn sessions, copy, and JSONL datasets
(traces: bench/traces.py).

Every request is drawn in turn from one seeded RNG (lengths, then token
ids), so the first k requests of a 32-request run are the first k of the
full 256-request run: a scaled-down smoke run measures a prefix of the real
workload, not a different one.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.stats import poisson_arrivals

# Ids 0-2 are <unk>, <s>, </s> in every model we serve; a random prompt must
# not contain them, or EOS/BOS handling would differ between engines.
FIRST_REGULAR_ID = 3
# Arrival times get their own RNG stream, so changing the rate never changes
# the prompts (and the other way round).
ARRIVAL_SEED_OFFSET = 1_000_003
# Spread of the log-normal length laws: median 128 then gives p90 ~ 360 and
# p99 ~ 820 before clipping, a real mix of short and long requests.
DEFAULT_SIGMA = 0.8


@dataclass(slots=True)
class BenchRequest:
    """One request of a workload. Exactly one of prompt_token_ids /
    prompt_text is set; arrival_s is the offset from the run's start at
    which the client sends it (0 for offline)."""

    index: int
    max_tokens: int
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    arrival_s: float = 0.0
    # A constraint on the output (GenerateRequest.structured); None = free.
    structured: object | None = None
    # Multi-turn: the session this turn belongs to (None for a lone
    # request). prompt_token_ids is then only the new question: the client
    # sends the session's history (every earlier prompt and answer) before
    # it, once the previous turn has been answered.
    session: int | None = None
    turn: int = 0
    # Multi-turn: seconds the session waits after the previous turn's answer
    # before sending this turn (a user reading and typing; 0 for turn 0).
    think_s: float = 0.0

    @property
    def prompt_len(self) -> int | None:
        """Known only for token-id prompts; text is tokenized server-side."""
        return None if self.prompt_token_ids is None else len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Log-normal lengths with the given median, clipped to [lo, hi]."""

    median: float
    lo: int
    hi: int
    sigma: float = DEFAULT_SIGMA

    def __post_init__(self):
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"length bounds must satisfy 1 <= lo <= hi, got lo={self.lo} hi={self.hi}")
        if self.median <= 0 or self.sigma < 0:
            raise ValueError(f"need median > 0 and sigma >= 0, got median={self.median} sigma={self.sigma}")

    def sample(self, rng: random.Random) -> int:
        n = round(math.exp(rng.gauss(math.log(self.median), self.sigma)))
        return min(self.hi, max(self.lo, n))

    def scaled(self, factor: float) -> "LengthDist":
        """The same law shrunk or grown, so a smoke run keeps its shape."""
        lo = max(1, round(self.lo * factor))
        return LengthDist(max(self.median * factor, 1.0), lo, max(lo, round(self.hi * factor)), self.sigma)


MIXED_PROMPT = LengthDist(median=128, lo=16, hi=1024)
MIXED_OUTPUT = LengthDist(median=128, lo=8, hi=512)


@dataclass(frozen=True, slots=True)
class SharedPrefixSpec:
    num_requests: int = 128
    prefix_len: int = 512
    suffix_len: int = 32
    output_len: int = 64

    def scaled(self, prompt_factor: float, output_factor: float) -> "SharedPrefixSpec":
        return replace(self, prefix_len=max(1, round(self.prefix_len * prompt_factor)),
                       suffix_len=max(1, round(self.suffix_len * prompt_factor)),
                       output_len=max(1, round(self.output_len * output_factor)))


@dataclass(slots=True)
class Workload:
    """The requests plus what produced them, for the report."""

    name: str
    requests: list[BenchRequest]
    params: dict = field(default_factory=dict)


def random_token_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    if vocab_size <= FIRST_REGULAR_ID:
        raise ValueError(f"vocab_size {vocab_size} leaves no regular token ids")
    return [rng.randrange(FIRST_REGULAR_ID, vocab_size) for _ in range(n)]


def mixed(num_requests: int, vocab_size: int, seed: int = 0, prompt: LengthDist = MIXED_PROMPT,
          output: LengthDist = MIXED_OUTPUT) -> Workload:
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        prompt_len, max_tokens = prompt.sample(rng), output.sample(rng)
        requests.append(BenchRequest(i, max_tokens, prompt_token_ids=random_token_ids(rng, prompt_len, vocab_size)))
    return Workload("mixed", requests, {"num_requests": num_requests, "seed": seed, "vocab_size": vocab_size,
                                        "prompt": _dist_dict(prompt), "output": _dist_dict(output)})


def shared_prefix(vocab_size: int, seed: int = 0, spec: SharedPrefixSpec = SharedPrefixSpec()) -> Workload:
    rng = random.Random(seed)
    prefix = random_token_ids(rng, spec.prefix_len, vocab_size)
    requests = [
        BenchRequest(i, spec.output_len, prompt_token_ids=prefix + random_token_ids(rng, spec.suffix_len, vocab_size))
        for i in range(spec.num_requests)
    ]
    params = {"num_requests": spec.num_requests, "prefix_len": spec.prefix_len, "suffix_len": spec.suffix_len,
              "output_len": spec.output_len, "seed": seed, "vocab_size": vocab_size}
    return Workload("shared-prefix", requests, params)


def overload(rate: float, duration_s: float, vocab_size: int, seed: int = 0, prompt: LengthDist = MIXED_PROMPT,
             output: LengthDist = MIXED_OUTPUT) -> Workload:
    """Poisson arrivals at `rate` for `duration_s`, lengths as in mixed. The
    number of requests is whatever the Poisson stream yields."""
    arrivals = poisson_arrivals(rate, seed + ARRIVAL_SEED_OFFSET, duration_s=duration_s)
    work = mixed(len(arrivals), vocab_size, seed, prompt, output)
    for req, t in zip(work.requests, arrivals):
        req.arrival_s = t
    work.name = "overload"
    work.params.update(request_rate=rate, duration_s=duration_s)
    return work


@dataclass(frozen=True, slots=True)
class MultiTurnSpec:
    """Sessions of chat turns: the first question, then each turn a new
    question after the whole history. The defaults fit stories260K's 512
    positions: the fourth turn sends 432 tokens and ends at 496."""

    num_sessions: int = 32
    num_turns: int = 4
    first_len: int = 96
    question_len: int = 48
    answer_len: int = 64
    # Mean of the exponential pause between an answer and the next turn; 0
    # sends every next turn at once (a closed loop that saturates the server).
    think_time_s: float = 0.0

    def history_len(self, turns: int) -> int:
        """Tokens in a session after `turns` answered turns."""
        if turns == 0:
            return 0
        return self.first_len + (turns - 1) * self.question_len + turns * self.answer_len

    def scaled(self, prompt_factor: float, output_factor: float) -> "MultiTurnSpec":
        return replace(self, first_len=max(1, round(self.first_len * prompt_factor)),
                       question_len=max(1, round(self.question_len * prompt_factor)),
                       answer_len=max(1, round(self.answer_len * output_factor)))


def multi_turn(vocab_size: int, seed: int = 0, spec: MultiTurnSpec = MultiTurnSpec()) -> Workload:
    """Every session starts at once; a session's next turn is sent
    think_s after its previous answer is complete (bench.client.run_sessions).
    The requests are in turn order (turn 0 of every session, then turn 1...),
    and hold only each turn's new question."""
    rng = random.Random(seed)
    questions = [[random_token_ids(rng, spec.first_len if t == 0 else spec.question_len, vocab_size)
                  for t in range(spec.num_turns)] for _ in range(spec.num_sessions)]
    # Its own stream, so a think time leaves the questions of a seed as they were.
    think_rng = random.Random(f"think-{seed}")
    think = [[think_rng.expovariate(1 / spec.think_time_s) if t and spec.think_time_s else 0.0
              for t in range(spec.num_turns)] for _ in range(spec.num_sessions)]
    requests = [BenchRequest(t * spec.num_sessions + s, spec.answer_len, prompt_token_ids=questions[s][t], session=s,
                             turn=t, think_s=think[s][t])
                for t in range(spec.num_turns) for s in range(spec.num_sessions)]
    params = {"num_sessions": spec.num_sessions, "num_turns": spec.num_turns, "first_len": spec.first_len,
              "question_len": spec.question_len, "answer_len": spec.answer_len, "think_time_s": spec.think_time_s,
              "seed": seed,
              "vocab_size": vocab_size, "last_prompt_len": spec.history_len(spec.num_turns - 1) + spec.question_len}
    return Workload("multi-turn", requests, params)


# Copy: prompts whose answers repeat their input, as a code-edit agent's
# answer repeats most of the file it edits. A tiny model such as
# stories260K does not follow an instruction to repeat, so each prompt is
# built from text the served model itself produces: a story opening, the
# model's own greedy continuation of it, then the opening again. Having
# just read its own story after that opening, the model tells it again for
# a while. The first four openings are P21's (bench.speculative), so its
# prompts stay those its figures were measured on.
COPY_OPENINGS = (
    "Once upon a time", "The little dog", "One day, a big bird", "Lily and Tom went to the park. They",
    "Tim had a red ball.", "The sun was hot and", "Sue wanted to play with her cat.",
    "There was a big tree in the garden.", "Ben found a shiny rock.", "Mom said it was time for bed.",
    "A little fish lived in the sea.", "The girl saw a bird in the sky.", "Max and his dad went to the store.",
    "It was a rainy day and", "The old man had a small boat.", "Amy liked to draw pictures.",
)
COPY_NUM_REQUESTS = 8
COPY_SOURCE_TOKENS = 120
COPY_OUTPUT_TOKENS = 100


def copy_openings(num_requests: int) -> list[str]:
    """The opening of each request: the list in order, cycled past its end
    (a repeated opening makes a repeated prompt, which the prefix cache
    then holds whole)."""
    return [COPY_OPENINGS[i % len(COPY_OPENINGS)] for i in range(num_requests)]


def copy_prompts(openings: list[str], source_tokens: int, tokenize: Callable[[str, bool], list[int]],
                 generate: Callable[[list[int], int], list[int]], max_prompt_len: int | None = None
                 ) -> list[list[int]]:
    """Each opening's tokens (special tokens, i.e. BOS, included), the
    model's greedy continuation of them (`generate`, source_tokens long),
    then the opening's tokens again without special tokens. tokenize(text,
    add_special_tokens) and generate(prompt, max_tokens) are the served
    model's; each distinct opening is generated once. Raises ValueError
    when a prompt would pass max_prompt_len, before generating anything."""
    tokens = {text: (tokenize(text, True), tokenize(text, False)) for text in dict.fromkeys(openings)}
    for text, (opening, again) in tokens.items():
        length = len(opening) + source_tokens + len(again)
        if max_prompt_len is not None and length > max_prompt_len:
            raise ValueError(f"the prompt for {text!r} would be {length} tokens, past {max_prompt_len}")
    built = {text: opening + generate(opening, source_tokens) + again for text, (opening, again) in tokens.items()}
    return [list(built[text]) for text in openings]


def copy_workload(prompts: list[list[int]], source_tokens: int, output_tokens: int) -> Workload:
    """The copy requests, from copy_prompts' prompts; the report says how
    they were built."""
    requests = [BenchRequest(i, output_tokens, prompt_token_ids=p) for i, p in enumerate(prompts)]
    params = {"num_requests": len(prompts), "distinct_prompts": len({tuple(p) for p in prompts}),
              "source_tokens": source_tokens, "output_tokens": output_tokens,
              "prompts": f"each a story opening, the served model's own greedy continuation of it ({source_tokens} "
                         "tokens), then the opening again"}
    return Workload("copy", requests, params)


def with_poisson_arrivals(work: Workload, rate: float, seed: int) -> Workload:
    """Online mode: the same requests, sent in a seeded Poisson stream."""
    arrivals = poisson_arrivals(rate, seed + ARRIVAL_SEED_OFFSET, num=len(work.requests))
    for req, t in zip(work.requests, arrivals):
        req.arrival_s = t
    work.params["request_rate"] = rate
    return work


WARMUP_SEED_OFFSET = 7_919
WARMUP_MAX_TOKENS = 32
WARMUP_TEXT_PROMPT_LEN = 32


def warmup_requests(requests: list[BenchRequest], vocab_size: int, seed: int) -> list[BenchRequest]:
    """Requests shaped like the given ones (prompt lengths, output capped at
    WARMUP_MAX_TOKENS) but with fresh random tokens: they warm the engine
    without warming the prefix cache for the timed requests, which would
    inflate cached_prompt_tokens and speed."""
    rng = random.Random(seed + WARMUP_SEED_OFFSET)
    return [BenchRequest(i, min(r.max_tokens, WARMUP_MAX_TOKENS),
                         prompt_token_ids=random_token_ids(rng, r.prompt_len or WARMUP_TEXT_PROMPT_LEN, vocab_size))
            for i, r in enumerate(requests)]


def parse_jsonl(lines: Iterable[str], source: str = "<jsonl>") -> list[BenchRequest]:
    """Lines of {"prompt": str | "prompt_token_ids": [int], "max_tokens": int}.
    Blank lines are skipped; anything else malformed raises ValueError naming
    the line, since a silently dropped request would skew every figure."""
    requests: list[BenchRequest] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
        has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
        if has_text == has_ids:
            raise ValueError(f"{where}: give exactly one of 'prompt' and 'prompt_token_ids'")
        max_tokens = obj.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
        req = BenchRequest(len(requests), max_tokens)
        if has_text:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise ValueError(f"{where}: 'prompt' must be a non-empty string")
            req.prompt_text = obj["prompt"]
        else:
            ids = obj["prompt_token_ids"]
            if (not isinstance(ids, list) or not ids
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
                raise ValueError(f"{where}: 'prompt_token_ids' must be a non-empty list of non-negative integers")
            req.prompt_token_ids = list(ids)
        requests.append(req)
    if not requests:
        raise ValueError(f"{source}: no requests")
    return requests


def from_jsonl(path: str | Path, num_requests: int | None = None) -> Workload:
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        requests = parse_jsonl(f, str(path))
    if num_requests is not None:
        requests = requests[:num_requests]
    return Workload("dataset", requests, {"path": str(path), "num_requests": len(requests)})


def fit_to_context(requests: list[BenchRequest], max_model_len: int) -> int:
    """Shortens requests that could never fit the server's context (the
    server would reject them as INVALID_ARGUMENT): the prompt keeps at most
    max_model_len - 1 tokens, and the output what is left. Returns how many
    were changed, which the report prints. Text prompts have no known
    length here and are left alone."""
    changed = 0
    for req in requests:
        if req.prompt_token_ids is None:
            continue
        if len(req.prompt_token_ids) + req.max_tokens <= max_model_len:
            continue
        del req.prompt_token_ids[max_model_len - 1:]
        req.max_tokens = max(1, min(req.max_tokens, max_model_len - len(req.prompt_token_ids)))
        changed += 1
    return changed


def _dist_dict(d: LengthDist) -> dict:
    return {"median": d.median, "min": d.lo, "max": d.hi, "sigma": d.sigma}
