"""A structured-output constraint before it is compiled: what it may cost, and its canonical form.

`checked_source` refuses a constraint over the engine's limits (its size in characters, a JSON
schema's nesting depth: xgrammar's compile time grows steeply with it, 0.1 s at 128 levels of nested
arrays, 13 s at 400 and 48 s at 900) before anything compiles it, and returns what to compile: a
`GrammarSource`, the kind of xgrammar compile and its text. That text is the canonical form of the
constraint, and the compiled-grammar cache's key: a JSON schema is parsed, its annotation-only
keywords (`description`, `title`, `examples`, `$comment`) dropped from every subschema and each
subschema's keywords sorted; what is data (`enum`, `const`, `default`) and the order of properties
(the order in which they are generated) are kept. Two schemas that differ only in annotations or in
the order of their keywords compile once. The canonical text is what is compiled, so one key never
stands for two different grammars. Regexes and EBNF grammars are their own text (their nesting is
bounded by xgrammar's parser); a `choice` is the EBNF grammar of its strings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from punica.config import EngineConfig
from punica.engine.sampling_params import StructuredOutputs

ANNOTATIONS = frozenset({"description", "title", "examples", "$comment"})
# keywords whose value is one subschema, a list of subschemas, or a map of names to subschemas
SCHEMA_KEYWORDS = frozenset({"items", "additionalProperties", "additionalItems", "not", "if", "then", "else",
                             "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties",
                             "contentSchema"})
SCHEMA_LIST_KEYWORDS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
SCHEMA_MAP_KEYWORDS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
JSON_OBJECT_SCHEMA = '{"type":"object"}'


class GrammarError(ValueError):
    """A constraint refused before or while compiling: its message is f"structured_outputs.{kind}
    {problem}"; `kind` and `problem` let a caller name the constraint as its user wrote it."""

    def __init__(self, kind: str, problem: str):
        super().__init__(f"structured_outputs.{kind} {problem}")
        self.kind, self.problem = kind, problem


def rejected(kind: str, reason: str) -> GrammarError:
    """The GrammarError of a constraint the grammar engine rejects, for `reason`."""
    return GrammarError(kind, f"is not accepted by the grammar engine: {reason}")


@dataclass(frozen=True)
class GrammarLimits:
    """What one constraint may cost (EngineConfig's max_grammar_* fields)."""
    max_chars: int
    max_depth: int
    max_compile_seconds: float

    @classmethod
    def of(cls, config: EngineConfig) -> GrammarLimits:
        return cls(config.max_grammar_chars, config.max_grammar_depth, config.max_grammar_compile_seconds)


@dataclass(frozen=True)
class GrammarSource:
    """What to compile: `kind` is "json" (a JSON schema), "regex" or "grammar" (EBNF), `text` its
    canonical text; hashable, the compiled-grammar cache's key."""
    kind: str
    text: str


def checked_source(spec: StructuredOutputs, limits: GrammarLimits) -> GrammarSource:
    """The canonical source of a constraint within `limits`; GrammarError naming the limit otherwise."""
    if spec.json_object:
        return GrammarSource("json", JSON_OBJECT_SCHEMA)
    if spec.choice is not None:
        num_chars = sum(len(c) for c in spec.choice)
    else:
        num_chars = len(spec.json if spec.json is not None else spec.regex if spec.regex is not None else spec.grammar)
    if num_chars > limits.max_chars:
        raise GrammarError(spec.kind, f"has {num_chars} characters, over this server's limit of {limits.max_chars} "
                                      f"(--max-grammar-chars)")
    if spec.json is not None:
        schema = json.loads(spec.json)
        depth = nesting_depth(schema, limits.max_depth)
        if depth > limits.max_depth:
            raise GrammarError(spec.kind, f"nests objects and arrays more than {limits.max_depth} levels deep, "
                                          f"this server's limit (--max-grammar-depth)")
        return GrammarSource("json", json.dumps(_canonical(schema), ensure_ascii=False, separators=(",", ":")))
    if spec.regex is not None:
        return GrammarSource("regex", spec.regex)
    if spec.choice is not None:
        return GrammarSource("grammar", choice_grammar(spec.choice))
    return GrammarSource("grammar", spec.grammar)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar of exactly one of the strings (EBNF string literals escape as JSON's do)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def nesting_depth(value, max_depth: int) -> int:
    """How deep JSON objects and arrays nest in `value` (a scalar: 0), counted level by level (no
    recursion) and only up to max_depth + 1."""
    depth, level = 0, [value]
    while depth <= max_depth:
        containers = [v for v in level if isinstance(v, (dict, list))]
        if not containers:
            break
        depth += 1
        level = [child for c in containers for child in (c.values() if isinstance(c, dict) else c)]
    return depth


def _canonical(schema):
    """A subschema with its annotations dropped and its keywords sorted, its subschemas likewise."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key in sorted(schema):
        value = schema[key]
        if key in ANNOTATIONS:
            continue
        if key in SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
            value = {name: _canonical(sub) for name, sub in value.items()}  # in the schema's order
        elif key in SCHEMA_LIST_KEYWORDS and isinstance(value, list):
            value = [_canonical(sub) for sub in value]
        elif key in SCHEMA_KEYWORDS:
            value = _canonical(value)
        out[key] = value
    return out
