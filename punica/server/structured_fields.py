"""The request fields that constrain the output, as one punica.engine.sampling_params.StructuredOutputs:
OpenAI's `response_format` (json_object, json_schema) and vLLM's extensions (`structured_outputs`,
and the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`). A request sets at
most one of them; a malformed one is a 400 naming it (the grammar engine's own checks come when
the engine compiles it, also before anything is queued; its 400 names the field too, by the
request's Constraint)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from punica.engine.sampling_params import SamplingParamsError, StructuredOutputs
from punica.server.protocol_errors import ProtocolError

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_KEYS = {"json", "json_object", "regex", "choice", "grammar"}


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match, and the request field that says so (`response_format`,
    `response_format.json_schema.schema`, `structured_outputs.regex`, `guided_json`, `tools`, ...),
    which the grammar engine's rejection of it names."""
    spec: StructuredOutputs
    field: str


def _spec(field: str, **kwargs) -> Constraint:
    """The constraint of `kwargs`, set by the request field `field`; its errors name that field."""
    try:
        spec = StructuredOutputs(**kwargs)
    except SamplingParamsError as e:
        message = str(e)
        if field != "structured_outputs" and len(kwargs) == 1:
            message = message.replace(f"structured_outputs.{next(iter(kwargs))}", field)
        raise ProtocolError(message, param=field) from e
    return Constraint(spec, f"structured_outputs.{spec.kind}" if field == "structured_outputs" else field)


def response_format_spec(value: dict[str, Any] | None) -> Constraint | None:
    """OpenAI's response_format: text (None), json_object, or json_schema {name, schema, strict, description}."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return _spec("response_format", json_object=True)
    if kind == "json_schema" and set(value) == {"type", "json_schema"}:
        spec = value["json_schema"]
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not set(spec) <= {
                "name", "schema", "strict", "description"}:
            raise ProtocolError("response_format.json_schema must be an object with a string `name` and optional "
                                "`schema`, `strict` and `description`", param="response_format.json_schema")
        if spec.get("strict") not in (None, True, False):
            raise ProtocolError("response_format.json_schema.strict must be a bool",
                                param="response_format.json_schema.strict")
        return _spec("response_format.json_schema.schema", json=spec.get("schema", {}))
    raise ProtocolError('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                        '"json_schema", "json_schema": {...}}', param="response_format")


def constraint_spec(body) -> Constraint | None:
    """The one constraint a request sets (its response_format, structured_outputs or a guided_* field)."""
    given: dict[str, Constraint] = {}
    spec = response_format_spec(body.response_format)
    if spec is not None:
        given["response_format"] = spec
    if body.structured_outputs is not None:
        value = body.structured_outputs
        unknown = set(value) - STRUCTURED_KEYS
        if unknown:
            raise ProtocolError(f"structured_outputs has unknown keys: {', '.join(sorted(unknown))} (it takes one "
                                f"of {', '.join(sorted(STRUCTURED_KEYS))})", param="structured_outputs")
        given["structured_outputs"] = _spec("structured_outputs", **value)
    for field, key in GUIDED_FIELDS.items():
        value = getattr(body, field)
        if value is not None:
            given[field] = _spec(field, **{key: value})
    if len(given) > 1:
        raise ProtocolError(f"set at most one of {', '.join(given)}: each constrains the output",
                            param=next(iter(given)))
    return next(iter(given.values()), None)
