"""Function-call arguments that conform to the tool's JSON schema, built from a model's tokens.

A model whose weights cannot write JSON (the embedded thinker's are random) still has to
answer a forced tool call with arguments the client's function accepts: a real client
validates them against the function's signature, so ``{}`` for a function with a required
parameter is never run. :func:`fill_schema` walks the schema and takes every free choice (a
string's words, a number in its range, an enum's member, a boolean) from the tokens the model
generated for the call, so the arguments are the model's, and the schema's keywords bound
them. :func:`conforms` checks the result with ``jsonschema`` where it is installed.

Covered: ``type`` (one or a list), ``properties``/``required``/``minProperties``, ``items``
(a schema or a tuple of them) with ``minItems``/``maxItems``/``uniqueItems``, ``enum``,
``const``, ``anyOf``/``oneOf`` (the first alternative that is not null), ``allOf`` (merged),
``minimum``/``maximum`` and their exclusive forms, ``multipleOf``, ``minLength``/
``maxLength`` and the common ``format`` values. A ``pattern`` is not generated towards:
:func:`conforms` says so when the words do not match it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

#: Strings in a format a validator (or the client) may check, whatever the words.
_FORMATS = {
    "date-time": "2026-01-01T00:00:00Z",
    "date": "2026-01-01",
    "time": "00:00:00Z",
    "email": "user@example.com",
    "uri": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "ipv4": "192.0.2.1",
    "hostname": "example.com",
}
#: Nesting past this is filled with the smallest valid value (a schema may be recursive).
_MAX_DEPTH = 8


class TokenSource:
    """The model's generated tokens, read in turn (cycling when a schema wants more)."""

    def __init__(self, words: Sequence[str], ids: Sequence[int]) -> None:
        self._words = [w for w in (w.strip(" .,!?;:'\"") for w in words) if w] or ["value"]
        self._ids = list(ids) or [0]
        self._w = self._i = 0

    def word(self) -> str:
        word = self._words[self._w % len(self._words)]
        self._w += 1
        return word

    def number(self) -> int:
        value = self._ids[self._i % len(self._ids)]
        self._i += 1
        return value


def fill_schema(schema: Any, source: TokenSource, depth: int = 0) -> Any:
    """A value valid for ``schema`` (a JSON schema as a dict), its free choices from ``source``."""
    if not isinstance(schema, dict):
        return source.word()  # `true` or a missing schema: anything goes
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][source.number() % len(schema["enum"])]
    if isinstance(schema.get("allOf"), list):
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            if isinstance(part, dict):
                merged = _merge(merged, part)
        return fill_schema(merged, source, depth)
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            chosen = next((o for o in options if _kind(o) != "null"), options[0])
            base = {k: v for k, v in schema.items() if k != key}
            return fill_schema(_merge(base, chosen) if isinstance(chosen, dict) else chosen, source, depth)
    kind = _kind(schema)
    if kind == "object":
        return _object(schema, source, depth)
    if kind == "array":
        return _array(schema, source, depth)
    if kind in ("integer", "number"):
        return _number(schema, source, integer=kind == "integer")
    if kind == "boolean":
        return source.number() % 2 == 0
    if kind == "null":
        return None
    return _string(schema, source)


def conforms(value: Any, schema: Any) -> str | None:
    """None if ``value`` is valid for ``schema``, else why not. Without ``jsonschema``
    installed nothing is checked (None)."""
    try:
        import jsonschema
    except ImportError:  # optional: the filler's rules alone then
        return None
    if not isinstance(schema, dict):
        return None
    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except jsonschema.exceptions.SchemaError as exc:
        return f"the schema itself is invalid: {exc.message}"
    return None if error is None else error.message


def _kind(schema: Any) -> str:
    if not isinstance(schema, dict):
        return "string"
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if isinstance(kind, str):
        return kind
    if "properties" in schema or "required" in schema:
        return "object"
    if "items" in schema:
        return "array"
    if any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        return "number"
    return "string"


def _merge(a: dict, b: dict) -> dict:
    out = {**a, **b}
    if isinstance(a.get("properties"), dict) and isinstance(b.get("properties"), dict):
        out["properties"] = {**a["properties"], **b["properties"]}
    if isinstance(a.get("required"), list) and isinstance(b.get("required"), list):
        out["required"] = list(dict.fromkeys([*a["required"], *b["required"]]))
    return out


def _object(schema: dict, source: TokenSource, depth: int) -> dict:
    props = schema.get("properties")
    if not isinstance(props, dict):
        props = {}
    names = [n for n in schema.get("required") or () if isinstance(n, str)]
    # minProperties: the optional properties, in order, until there are enough.
    wanted = schema.get("minProperties") or 0
    for name in props:
        if len(names) >= wanted:
            break
        if name not in names:
            names.append(name)
    if depth >= _MAX_DEPTH:
        return {n: _smallest(props.get(n)) for n in names}
    return {n: fill_schema(props.get(n, {}), source, depth + 1) for n in names}


def _array(schema: dict, source: TokenSource, depth: int) -> list:
    items = schema.get("items", {})
    prefix = schema.get("prefixItems")
    if isinstance(items, list):  # draft 4-7 tuple form
        prefix, items = items, schema.get("additionalItems", {})
    prefix = prefix if isinstance(prefix, list) else []
    low = max(int(schema.get("minItems") or 0), len(prefix) if prefix else 0)
    high = schema.get("maxItems")
    # One item at least, where allowed: an empty list is valid but says nothing.
    count = max(low, 1 if high is None or high >= 1 else 0)
    if depth >= _MAX_DEPTH:
        return [_smallest(prefix[i] if i < len(prefix) else items) for i in range(low)]
    out: list = []
    tries = 0
    while len(out) < count and tries < count * 8:
        tries += 1
        i = len(out)
        item_schema = prefix[i] if i < len(prefix) else items
        value = fill_schema(item_schema, source, depth + 1)
        if schema.get("uniqueItems") and value in out:
            # An enum's next unused member; anything else is drawn again from the tokens.
            members = item_schema.get("enum") if isinstance(item_schema, dict) else None
            unused = [m for m in members or () if m not in out]
            if not unused:
                continue
            value = unused[0]
        out.append(value)
    return out


def _number(schema: dict, source: TokenSource, *, integer: bool) -> int | float:
    low = _bound(schema, "minimum", "exclusiveMinimum", up=True, integer=integer)
    high = _bound(schema, "maximum", "exclusiveMaximum", up=False, integer=integer)
    pick = source.number()
    if low is not None and high is not None:
        if high < low:  # no integer in range (a fractional interval): its middle
            return (low + high) / 2
        span = int(high - low)
        value: int | float = low + (pick % (span + 1)) if span >= 0 else low
    elif low is not None:
        value = low + pick % 100
    elif high is not None:
        value = high - pick % 100
    else:
        value = pick % 100
    step = schema.get("multipleOf")
    if isinstance(step, (int, float)) and step > 0:
        snapped = math.ceil(value / step) * step
        if high is not None and snapped > high:
            snapped = math.floor(value / step) * step
        value = int(snapped) if integer or float(snapped).is_integer() else snapped
    return int(value) if integer else value


def _bound(schema: dict, inclusive: str, exclusive: str, *, up: bool, integer: bool) -> float | None:
    """The inclusive bound a value may take (an integer one where it can be)."""
    value = schema.get(inclusive)
    ex = schema.get(exclusive)
    if isinstance(ex, bool):  # draft 4: exclusiveMinimum is a flag on minimum
        ex, value = (value if ex else None), (None if ex else value)
    candidates = []
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        candidates.append(math.ceil(value) if up else math.floor(value))
    if isinstance(ex, (int, float)) and not isinstance(ex, bool):
        nearest = math.floor(ex) + 1 if up else math.ceil(ex) - 1
        candidates.append(nearest)
    if not candidates:
        return None
    return max(candidates) if up else min(candidates)


def _string(schema: dict, source: TokenSource) -> str:
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in _FORMATS:
        return _FORMATS[fmt]
    low = int(schema.get("minLength") or 0)
    high = schema.get("maxLength")
    text = source.word()
    while len(text) < low:
        text += " " + source.word()
    if isinstance(high, int) and len(text) > high:
        text = text[:high]
    return text


def _smallest(schema: Any) -> Any:
    """The least value of a schema's kind, where nesting is cut off."""
    kind = _kind(schema)
    return {"object": {}, "array": [], "integer": 0, "number": 0, "boolean": False, "null": None}.get(
        kind, ""
    )
