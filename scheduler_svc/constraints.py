"""Constrained decoding, the scheduler's half: turns a request's
`structured` field into an llguidance grammar and checks that it compiles
against the model's tokenizer, before the request is queued.

The executor enforces the grammar (executor_svc/step/constraints.py): it keeps
one matcher per constrained request, computes each step's token mask while
the forward pass runs, masks the logits before sampling and advances the
matcher with the token it sampled. Matchers live where the token is
sampled because, with two plans in flight, the mask for step N+1 depends
on the token of step N, which the scheduler sees only after plan N+1 has
gone out; the executor has it at once, so no row waits for a mask and the
executor never waits for the scheduler.

Compilation runs on worker threads (llguidance releases the GIL), with a
time limit, and results are cached by content (LRU): an agent sends the
same schema over and over. A grammar the engine cannot handle is refused
as InvalidRequest naming the field and llguidance's reason.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
from llguidance import LLMatcher
from prometheus_client import Counter, Histogram

from scheduler_svc.core.clock import SYSTEM_CLOCK
from scheduler_svc.core.request import CompiledConstraint
from scheduler_svc.validation import ConstraintSpec, InvalidRequest

# JSON is written compactly unless a schema's own "x-guidance" says
# otherwise: with free whitespace between tokens a model can pad forever
# (vLLM users hit this as "whitespace loops"), and compact JSON is as valid.
JSON_DEFAULTS = {"whitespace_flexible": False}

CONSTRAINED = Counter("llmsched_constrained_requests", "Requests admitted with a constraint, by kind", ["kind"])
COMPILE_SECONDS = Histogram(
    "llmsched_constraint_compile_seconds", "Time to compile and check a constraint (cache misses only)",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
COMPILE_CACHE_HITS = Counter("llmsched_constraint_cache_hits", "Constraints found compiled in the cache")
# llguidance reports where in a grammar it failed as "at LINE(COLUMN)".
_GRAMMAR_LINE = re.compile(r"\bat (\d+)\(\d+\)")


def grammar_line(message: str) -> int | None:
    """The grammar line (1-based) llguidance's error message blames, if any."""
    found = _GRAMMAR_LINE.search(message)
    return int(found.group(1)) if found else None


@dataclass(frozen=True, slots=True)
class Refusal:
    """A constraint that does not compile, cached like one that does."""

    field: str
    message: str


def grammar_of(spec: ConstraintSpec) -> str:
    """The llguidance grammar for spec, not yet checked. Raises InvalidRequest
    for a JSON Schema that is not JSON."""
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.text)
        except ValueError as exc:
            raise InvalidRequest(spec.field, f"not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(spec.field, f"a JSON Schema is an object or a boolean, not {type(schema).__name__}")
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        # A Lark alternation of string literals; JSON's escaping is Lark's.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(v) for v in json.loads(spec.text)))
    if spec.kind == "grammar":
        return LLMatcher.grammar_from_lark(spec.text)
    raise AssertionError(f"unknown constraint kind {spec.kind!r}")


class ConstraintCompiler:
    """Compiles and checks constraints for one tokenizer, off the event
    loop, each within timeout_s, remembering the last cache_size results
    (refusals included: the same bad schema is refused again at once)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, timeout_s: float, cache_size: int, threads: int = 2):
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[ConstraintSpec, CompiledConstraint | Refusal] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="constraint-compile")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        """The compiled constraint, or InvalidRequest naming spec's field."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
        if cached is not None:
            COMPILE_CACHE_HITS.inc()
        else:
            future = asyncio.get_running_loop().run_in_executor(self._pool, self._compile_now, spec)
            try:
                cached = await asyncio.wait_for(future, self.timeout_s)
            except asyncio.TimeoutError:
                # The thread runs on; its result is not cached, so the same
                # constraint is refused the same way next time.
                raise InvalidRequest(spec.field, f"did not compile within {self.timeout_s:g} s "
                                                 "(SCHEDULER_CONSTRAINT_COMPILE_TIMEOUT_S)") from None
            with self._lock:
                self._cache[spec] = cached
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(cached, Refusal):
            raise InvalidRequest(cached.field, cached.message, grammar_line(cached.message))
        CONSTRAINED.labels(spec.kind).inc()
        return cached

    def _compile_now(self, spec: ConstraintSpec) -> CompiledConstraint | Refusal:
        started = SYSTEM_CLOCK.perf_counter()
        try:
            grammar = grammar_of(spec)
            # Builds the parser and lexer against this vocabulary: the errors
            # a matcher would meet are found here, before anything is queued.
            is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        except InvalidRequest as exc:
            return Refusal(exc.field, exc.message)
        except ValueError as exc:
            return Refusal(spec.field, str(exc))
        finally:
            COMPILE_SECONDS.observe(SYSTEM_CLOCK.perf_counter() - started)
        if is_error:
            return Refusal(spec.field, "; ".join(m.strip() for m in messages) or "does not compile")
        return CompiledConstraint(spec.kind, grammar)
