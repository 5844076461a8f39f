"""Checks a GenerateRequest before anything is queued. Every failure names
the offending field, and the caller maps it to INVALID_ARGUMENT."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from llmsched.v1 import scheduler_pb2 as spb
from scheduler_svc.core.request import SamplingParams

DEFAULT_MAX_TOKENS = 16
MAX_REQUEST_ID_CHARS = 256


class InvalidRequest(ValueError):
    """A refused request: the field, what is wrong with it, and for a
    grammar that did not compile the line llguidance blamed (1-based)."""

    def __init__(self, field: str, message: str, grammar_line: int | None = None):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.grammar_line = grammar_line


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int
    max_model_len: int
    max_logprobs: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_stop_token_ids: int
    max_logit_bias: int = 1024


def validate_prompt(req: spb.GenerateRequest | spb.EmbedRequest, limits: Limits) -> None:
    has_text, has_ids = bool(req.prompt), len(req.prompt_token_ids) > 0
    if has_text == has_ids:
        raise InvalidRequest("prompt", "set exactly one of prompt and prompt_token_ids")
    for i, t in enumerate(req.prompt_token_ids):
        if t >= limits.vocab_size:
            raise InvalidRequest(f"prompt_token_ids[{i}]", f"token id {t} is outside the vocabulary (size {limits.vocab_size})")
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest("request_id", f"longer than {MAX_REQUEST_ID_CHARS} characters")


def sampling_from_proto(s: spb.SamplingParams, limits: Limits) -> SamplingParams:
    max_tokens = s.max_tokens or DEFAULT_MAX_TOKENS
    if max_tokens > limits.max_model_len:
        raise InvalidRequest("sampling.max_tokens", f"{max_tokens} exceeds max_model_len {limits.max_model_len}")
    temperature = s.temperature if s.HasField("temperature") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest("sampling.temperature", f"must be a finite number >= 0, got {temperature}")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {top_p}")
    if s.top_k > limits.vocab_size:
        raise InvalidRequest("sampling.top_k", f"{s.top_k} exceeds the vocabulary size {limits.vocab_size}")
    if len(s.stop) > limits.max_stop_strings:
        raise InvalidRequest("sampling.stop", f"at most {limits.max_stop_strings} stop strings, got {len(s.stop)}")
    for i, stop in enumerate(s.stop):
        if not stop:
            raise InvalidRequest(f"sampling.stop[{i}]", "empty stop string")
        if len(stop) > limits.max_stop_string_chars:
            raise InvalidRequest(f"sampling.stop[{i}]", f"longer than {limits.max_stop_string_chars} characters")
    if len(s.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequest("sampling.stop_token_ids", f"at most {limits.max_stop_token_ids} ids, got {len(s.stop_token_ids)}")
    for i, t in enumerate(s.stop_token_ids):
        if t >= limits.vocab_size:
            raise InvalidRequest(f"sampling.stop_token_ids[{i}]", f"token id {t} is outside the vocabulary")
    if s.logprobs > limits.max_logprobs:
        raise InvalidRequest("sampling.logprobs", f"at most {limits.max_logprobs}, got {s.logprobs}")
    prompt_logprobs = s.prompt_logprobs if s.HasField("prompt_logprobs") else None
    if prompt_logprobs is not None and prompt_logprobs > limits.max_logprobs:
        raise InvalidRequest("sampling.prompt_logprobs", f"at most {limits.max_logprobs}, got {prompt_logprobs}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise InvalidRequest(f"sampling.{name}", f"must be in [-2, 2], got {value}")
    repetition_penalty = s.repetition_penalty if s.HasField("repetition_penalty") else 1.0
    if not (math.isfinite(repetition_penalty) and repetition_penalty > 0):
        raise InvalidRequest("sampling.repetition_penalty", f"must be a finite number > 0, got {repetition_penalty}")
    if not (math.isfinite(s.min_p) and 0.0 <= s.min_p <= 1.0):
        raise InvalidRequest("sampling.min_p", f"must be in [0, 1], got {s.min_p}")
    if s.min_tokens > max_tokens:
        raise InvalidRequest("sampling.min_tokens", f"{s.min_tokens} exceeds max_tokens {max_tokens}")
    if len(s.logit_bias) > limits.max_logit_bias:
        raise InvalidRequest("sampling.logit_bias", f"at most {limits.max_logit_bias} entries, got {len(s.logit_bias)}")
    for token, bias in s.logit_bias.items():
        if token >= limits.vocab_size:
            raise InvalidRequest("sampling.logit_bias", f"token id {token} is outside the vocabulary "
                                                        f"(size {limits.vocab_size})")
        if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
            raise InvalidRequest("sampling.logit_bias", f"the bias of token {token} must be in [-100, 100], got {bias}")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=frozenset(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        presence_penalty=float(s.presence_penalty),
        frequency_penalty=float(s.frequency_penalty),
        repetition_penalty=float(repetition_penalty),
        min_p=float(s.min_p),
        min_tokens=s.min_tokens,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in s.logit_bias.items())),
        prompt_logprobs=prompt_logprobs,
    )


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """What the client asked for: one of the StructuredOutput kinds."""

    kind: str  # the oneof field's name: json_schema, json_object, regex, choice, grammar
    text: str  # the schema, regex or grammar; choices as a JSON list; "" for json_object

    @property
    def field(self) -> str:
        return f"structured.{self.kind}"


def spec_from_proto(msg: spb.StructuredOutput) -> ConstraintSpec:
    """Checks the message's shape; what the constraint means is checked by
    compiling it."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        raise InvalidRequest("structured", "set one of json_schema, json_object, regex, choice, grammar")
    field = f"structured.{kind}"
    if kind == "json_object":
        if not msg.json_object:
            raise InvalidRequest(field, "must be true (it asks for any JSON object)")
        return ConstraintSpec(kind, "")
    if kind == "choice":
        values = list(msg.choice.values)
        if not values:
            raise InvalidRequest("structured.choice.values", "needs at least one string")
        for i, v in enumerate(values):
            if not v:
                raise InvalidRequest(f"structured.choice.values[{i}]", "empty string")
        return ConstraintSpec(kind, json.dumps(values))
    text = getattr(msg, kind)
    if not text:
        raise InvalidRequest(field, "empty")
    return ConstraintSpec(kind, text)
