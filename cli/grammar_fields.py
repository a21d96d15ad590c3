"""A line's grammar, from its fields: what constrains its output, if anything.

Contract: each function reads one format's fields and returns a checked
``Grammar`` (``metrale.engine.api``), or None when the line asks for none; a
malformed field, or a schema or regex that does not compile, raises
``LineFault`` naming the field, so the line becomes an error record (status
400 in the Batch format) and the other lines go on. Checking needs no model
(``metrale.engine.spec.grammar.grammar_problem``), and each distinct grammar
is checked once.

- simple lines: at most one of ``json_schema`` (a schema object), ``regex``
  (a string) and ``choice`` (a list of strings);
- Batch bodies: ``response_format`` ``{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"?, "description"?}}``, ``{"type":
  "json_object"}`` or ``{"type": "text"}`` (no grammar);
- a line that names none takes the run's ``--json-schema FILE``.

A grammar and a stop string do not go together: a stop string would end the
output before the grammar is complete.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from metrale.cli.faults import LineFault
from metrale.engine.api import Grammar
from metrale.engine.spec.grammar import choice_grammar, grammar_problem, json_schema_grammar

SIMPLE_GRAMMAR_FIELDS = ("json_schema", "regex", "choice")
JSON_SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})
KIND_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
}


def simple_grammar(obj: dict[str, Any]) -> Grammar | None:
    """The grammar a simple line names, checked; None when it names none."""
    named = [name for name in SIMPLE_GRAMMAR_FIELDS if obj.get(name) is not None]
    if len(named) > 1:
        raise LineFault(named[1], f"give at most one of {', '.join(SIMPLE_GRAMMAR_FIELDS)}")
    if not named:
        return None
    name, value = named[0], obj[named[0]]
    if name == "json_schema":
        if not isinstance(value, dict):
            raise LineFault(name, "must be a JSON schema object")
        return checked(json_schema_grammar(value), name)
    if name == "regex":
        if not isinstance(value, str) or not value:
            raise LineFault(name, "must be a non-empty string")
        return checked(Grammar("regex", value), name)
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise LineFault(name, "must be a non-empty list of non-empty strings")
    return checked(choice_grammar(value), name)


def batch_grammar(body: dict[str, Any], prefix: str = "body.") -> Grammar | None:
    """The grammar of a Batch body's ``response_format``; None for text."""
    where = f"{prefix}response_format"
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise LineFault(where, "must be an object with a type")
    kind = value.get("type")
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return Grammar("json_object")
    if kind != "json_schema":
        raise LineFault(f"{where}.type", "must be text, json_object or json_schema")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise LineFault(f"{where}.json_schema", "must be an object with a schema object")
    unknown = sorted(set(spec) - JSON_SCHEMA_KEYS) + sorted(set(value) - {"type", "json_schema"})
    if unknown:
        raise LineFault(f"{where}.json_schema.{unknown[0]}", "is not supported")
    if "name" in spec and not isinstance(spec["name"], str):
        raise LineFault(f"{where}.json_schema.name", "must be a string")
    if "strict" in spec and not isinstance(spec["strict"], bool | None):
        raise LineFault(f"{where}.json_schema.strict", "must be true or false")
    return checked(json_schema_grammar(spec["schema"]), f"{where}.json_schema.schema")


def checked(grammar: Grammar, field: str) -> Grammar:
    """``grammar`` if it compiles; else a ``LineFault`` on ``field`` saying why."""
    problem = grammar_problem(grammar)
    if problem is not None:
        raise LineFault(field, f"invalid {KIND_NAMES[grammar.kind]}: {problem}")
    return grammar


def schema_file_grammar(path: Path) -> Grammar:
    """The grammar of ``--json-schema FILE``; ``ValueError`` naming what is wrong."""
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read a JSON schema from {path}: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{path} must hold a JSON schema object")
    try:
        return checked(json_schema_grammar(schema), str(path))
    except LineFault as fault:
        raise ValueError(f"{path}: {fault.message}") from None
