"""Constraints on the output, from the request fields clients send for
them, as the one `GenerateRequest.structured` the scheduler enforces:

- OpenAI's `response_format` (`json_object`, `json_schema`);
- vLLM's `structured_outputs` (`json`, `json_object`, `regex`, `choice`,
  `grammar`) and its older `guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar`;
- a forced tool call (gateway_svc/tools.py builds that grammar).

At most one per request. The scheduler compiles it and refuses what it
cannot (a bad regex, a grammar syntax error, a schema keyword the engine
does not implement) with INVALID_ARGUMENT naming `structured.*`; the
Constraint remembers which request field it came from, so that the 400 names
the field the client wrote. A schema that is not valid JSON Schema at all is
refused here, before anything is sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from jsonschema import Draft202012Validator, SchemaError
from jsonschema.validators import validator_for

from gateway_svc.protocol import RequestError
from llmsched.v1 import scheduler_pb2 as spb

@dataclass(frozen=True, slots=True)
class Constraint:
    structured: spb.StructuredOutput
    param: str  # the request field it came from, named in errors
    kind: str  # json_schema, json_object, regex, choice, grammar or tool_call (a metrics label)
    # For a grammar the gateway wrote: its line (1-based) -> the request
    # field that line came from, e.g. a tool's parameter schema.
    line_params: dict[int, str] = field(default_factory=dict)

    def param_for(self, grammar_line: int | None) -> str:
        """The request field to blame for the scheduler's compile error, by
        the grammar line it names (its llmsched-grammar-line detail)."""
        return self.line_params.get(grammar_line, self.param)


def json_schema_of(value, param: str) -> dict | bool:
    """A JSON Schema from a request field (an object, or a string holding
    one), checked against its meta-schema."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RequestError(param, f"{param}: not valid JSON: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise RequestError(param, f"{param}: a JSON Schema is an object or a boolean")
    if isinstance(value, dict):
        try:
            validator_for(value, default=Draft202012Validator).check_schema(value)
        except SchemaError as exc:
            where = "".join(f"[{p!r}]" for p in exc.absolute_path) or "the top level"
            raise RequestError(param, f"{param}: not a valid JSON Schema at {where}: {exc.message}") from None
    return value


def _schema(value, param: str) -> Constraint:
    schema = json_schema_of(value, param)
    return Constraint(spb.StructuredOutput(json_schema=json.dumps(schema, ensure_ascii=False)), param, "json_schema")


def _json_object(value: bool, param: str) -> Constraint | None:
    return Constraint(spb.StructuredOutput(json_object=True), param, "json_object") if value else None


def _regex(value: str, param: str) -> Constraint:
    return Constraint(spb.StructuredOutput(regex=value), param, "regex")


def _choice(values: list[str], param: str) -> Constraint:
    if not values:
        raise RequestError(param, f"{param}: give at least one choice")
    for i, value in enumerate(values):
        if not value:
            raise RequestError(param, f"{param}[{i}]: a choice cannot be empty")
    return Constraint(spb.StructuredOutput(choice=spb.Choice(values=values)), param, "choice")


def _grammar(value: str, param: str) -> Constraint:
    return Constraint(spb.StructuredOutput(grammar=value), param, "grammar")


def _response_format(rf) -> Constraint | None:
    if rf.type == "json_object":
        return _json_object(True, "response_format")
    if rf.type == "json_schema":
        if rf.json_schema is None:
            raise RequestError("response_format.json_schema",
                               "response_format.json_schema: type json_schema needs a json_schema object")
        if rf.json_schema.schema_ is None:
            raise RequestError("response_format.json_schema.schema", "response_format.json_schema.schema: missing")
        return _schema(rf.json_schema.schema_, "response_format.json_schema.schema")
    return None  # text


def from_request(body) -> Constraint | None:
    """The request's one constraint, or None; a 400 naming the second field
    when a request sets two."""
    found: list[Constraint] = []
    if body.response_format is not None:
        found.append(_response_format(body.response_format))
    so = body.structured_outputs
    if so is not None:
        found += [
            so.json_ is not None and _schema(so.json_, "structured_outputs.json"),
            so.json_object is not None and _json_object(so.json_object, "structured_outputs.json_object"),
            so.regex is not None and _regex(so.regex, "structured_outputs.regex"),
            so.choice is not None and _choice(so.choice, "structured_outputs.choice"),
            so.grammar is not None and _grammar(so.grammar, "structured_outputs.grammar"),
        ]
    found += [
        body.guided_json is not None and _schema(body.guided_json, "guided_json"),
        body.guided_regex is not None and _regex(body.guided_regex, "guided_regex"),
        body.guided_choice is not None and _choice(body.guided_choice, "guided_choice"),
        body.guided_grammar is not None and _grammar(body.guided_grammar, "guided_grammar"),
    ]
    found = [c for c in found if c]
    if len(found) > 1:
        raise RequestError(found[1].param, f"{found[1].param}: at most one constraint per request, and "
                                           f"{found[0].param} is already set")
    return found[0] if found else None
