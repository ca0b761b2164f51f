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

The schema is the client's, so both steps are bounded as hostile input. A schema's
``minItems``/``minLength`` could ask for a billion values (a value a microsecond, on the
engine's loop, and gigabytes); the filler writes at most ``max_values`` values and
``max_chars`` characters of text, as a model writes arguments within its token limit, and a
schema that needs more is :class:`UnfillableSchema`. A ``pattern`` that backtracks
catastrophically (``^(\\w+\\s?)*!$`` against forty characters of words) holds Python's ``re``,
and the GIL with it, for minutes: :func:`conforms` searches every pattern with ``regex``, its
time bounded, the GIL let go while it matches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
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
#: What one call's arguments may hold: JSON values, and characters of string text. A real
#: model writes its arguments within its token limit; these are far above any real function's.
MAX_VALUES = 4096
MAX_CHARS = 65536
#: How long all of one call's ``pattern`` checks may take together.
PATTERN_TIME_S = 0.25


class UnfillableSchema(ValueError):
    """No arguments within the filler's limits are valid for the schema (it asks for more
    values or text than a call may hold, or for a number no float reaches)."""


class TokenSource:
    """The model's generated tokens, read in turn (cycling when a schema wants more), and what
    the arguments built from them may still hold."""

    def __init__(
        self,
        words: Sequence[str],
        ids: Sequence[int],
        *,
        max_values: int = MAX_VALUES,
        max_chars: int = MAX_CHARS,
    ) -> None:
        self._words = [w for w in (w.strip(" .,!?;:'\"") for w in words) if w] or ["value"]
        self._ids = list(ids) or [0]
        self._w = self._i = 0
        self.values_left = max_values
        self.chars_left = max_chars

    def spend(self, values: int, chars: int = 0) -> None:
        """Count what the arguments are about to hold; refused before it is built."""
        if values > self.values_left or chars > self.chars_left:
            raise UnfillableSchema(
                f"the schema asks for more than a call's arguments may hold ({MAX_VALUES} "
                f"values, {MAX_CHARS} characters)"
            )
        self.values_left -= values
        self.chars_left -= chars

    def word(self) -> str:
        word = self._words[self._w % len(self._words)]
        self._w += 1
        return word

    def number(self) -> int:
        value = self._ids[self._i % len(self._ids)]
        self._i += 1
        return value


def fill_arguments(schema: Any, source: TokenSource) -> Any:
    """:func:`fill_schema` for a whole call: whatever the client's schema asks that no value
    within the limits can give is :class:`UnfillableSchema`, never another exception."""
    try:
        return fill_schema(schema, source)
    except UnfillableSchema:
        raise
    except ArithmeticError as exc:
        # A bound or step no float reaches (multipleOf 1e-320, minimum 1e308 and up).
        raise UnfillableSchema(f"no value fits the schema's numbers: {exc}") from None
    except (ValueError, TypeError) as exc:  # a keyword's value of a kind the filler cannot use
        raise UnfillableSchema(f"the schema cannot be filled: {exc}") from None


def fill_schema(schema: Any, source: TokenSource, depth: int = 0) -> Any:
    """A value valid for ``schema`` (a JSON schema as a dict), its free choices from ``source``."""
    source.spend(1)
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


def conforms(value: Any, schema: Any, pattern_time_s: float = PATTERN_TIME_S) -> str | None:
    """None if ``value`` is valid for ``schema``, else why not. Without ``jsonschema`` and
    ``regex`` installed nothing is checked (None).

    ``jsonschema`` searches patterns with ``re``, whose backtracking cannot be stopped and
    holds the GIL; so the keywords that search (``pattern``, ``patternProperties``,
    ``additionalProperties`` beside them) are replaced by the same rules searching with
    ``regex``, all of them within ``pattern_time_s`` together. ``unevaluatedProperties`` next
    to ``patternProperties`` would search with ``re`` again: such a schema is not checked,
    and says so (the call fails rather than go out unchecked)."""
    try:
        import jsonschema
        import regex
    except ImportError:  # optional: the filler's rules alone then
        return None
    if not isinstance(schema, dict):
        return None
    if _holds_key(schema, "patternProperties") and _holds_key(schema, "unevaluatedProperties"):
        return "a schema with both patternProperties and unevaluatedProperties is not checked"
    patterns = _PatternClock(regex, pattern_time_s)
    try:
        base = jsonschema.validators.validator_for(schema)
        # The validator trusts its schema: one that is not valid JSON Schema ({"type": null})
        # raised inside its rules.
        base.check_schema(schema)
        validator = jsonschema.validators.extend(base, patterns.keywords(jsonschema))(schema)
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except jsonschema.exceptions.SchemaError as exc:
        return f"the schema itself is invalid: {exc.message}"
    except TimeoutError:
        return f"the schema's patterns took longer than {pattern_time_s} s to check"
    except regex.error as exc:
        return f"the schema holds a pattern that is not a regular expression: {exc}"
    except RecursionError:
        return "the schema refers to itself without end"
    except Exception as exc:  # the client's schema: its call fails, the engine does not
        return f"the schema could not be checked: {type(exc).__name__}: {exc}"
    return None if error is None else error.message


class _PatternClock:
    """Pattern searches with ``regex`` against one deadline for a whole check."""

    def __init__(self, regex: Any, budget_s: float) -> None:
        self._regex = regex
        self._deadline = time.monotonic() + budget_s

    def search(self, pattern: str, text: str) -> bool:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        # concurrent: the GIL is let go while it matches, so the process's other threads (the
        # event loop, when this runs off it) go on meanwhile.
        return self._regex.search(pattern, text, timeout=left, concurrent=True) is not None

    def keywords(self, jsonschema: Any) -> dict[str, Callable[[Any, Any, Any, Any], Iterator[Any]]]:
        """``pattern``, ``patternProperties`` and ``additionalProperties`` as jsonschema's own
        rules have them, searching with :meth:`search`."""
        ValidationError = jsonschema.exceptions.ValidationError
        search = self.search

        def pattern(validator: Any, wanted: Any, instance: Any, schema: Any) -> Iterator[Any]:
            if validator.is_type(instance, "string") and not search(wanted, instance):
                yield ValidationError(f"{instance!r} does not match {wanted!r}")

        def pattern_properties(validator: Any, by_pattern: Any, instance: Any, schema: Any) -> Iterator[Any]:
            if not validator.is_type(instance, "object"):
                return
            for wanted, subschema in by_pattern.items():
                for key, item in instance.items():
                    if search(wanted, key):
                        yield from validator.descend(item, subschema, path=key, schema_path=wanted)

        def additional_properties(validator: Any, allowed: Any, instance: Any, schema: Any) -> Iterator[Any]:
            if not validator.is_type(instance, "object"):
                return
            extras = sorted(_additional(instance, schema, search), key=str)
            if validator.is_type(allowed, "object"):
                for key in extras:
                    yield from validator.descend(instance[key], allowed, path=key)
            elif not allowed and extras:
                yield ValidationError(f"additional properties are not allowed: {extras!r}")

        return {
            "pattern": pattern,
            "patternProperties": pattern_properties,
            "additionalProperties": additional_properties,
        }


def _additional(instance: dict[str, Any], schema: dict[str, Any], search: Any) -> Iterator[str]:
    """The keys of ``instance`` neither ``properties`` nor ``patternProperties`` names."""
    named = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    for key in instance:
        if key not in named and not any(search(p, key) for p in patterns):
            yield key


def _holds_key(schema: Any, key: str) -> bool:
    if isinstance(schema, dict):
        return key in schema or any(_holds_key(v, key) for v in schema.values())
    if isinstance(schema, list):
        return any(_holds_key(v, key) for v in schema)
    return False


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


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = {**a, **b}
    if isinstance(a.get("properties"), dict) and isinstance(b.get("properties"), dict):
        out["properties"] = {**a["properties"], **b["properties"]}
    if isinstance(a.get("required"), list) and isinstance(b.get("required"), list):
        out["required"] = list(dict.fromkeys([*a["required"], *b["required"]]))
    return out


def _object(schema: dict[str, Any], source: TokenSource, depth: int) -> dict[str, Any]:
    props = schema.get("properties")
    if not isinstance(props, dict):
        props = {}
    required = schema.get("required")
    names = [n for n in required if isinstance(n, str)] if isinstance(required, list) else []
    # minProperties: the optional properties, in order, until there are enough.
    wanted = _count(schema, "minProperties")
    for name in props:
        if len(names) >= wanted:
            break
        if name not in names:
            names.append(name)
    if depth >= _MAX_DEPTH:
        source.spend(len(names))
        return {n: _smallest(props.get(n)) for n in names}
    return {n: fill_schema(props.get(n, {}), source, depth + 1) for n in names}


def _array(schema: dict[str, Any], source: TokenSource, depth: int) -> list[Any]:
    items = schema.get("items", {})
    prefix = schema.get("prefixItems")
    if isinstance(items, list):  # draft 4-7 tuple form
        prefix, items = items, schema.get("additionalItems", {})
    prefix = prefix if isinstance(prefix, list) else []
    low = max(_count(schema, "minItems"), len(prefix) if prefix else 0)
    high = schema.get("maxItems")
    # One item at least, where allowed: an empty list is valid but says nothing.
    count = max(low, 1 if not isinstance(high, (int, float)) or high >= 1 else 0)
    if low > source.values_left:  # refused before a billion items are built
        source.spend(low)
    if depth >= _MAX_DEPTH:
        source.spend(low)
        return [_smallest(prefix[i] if i < len(prefix) else items) for i in range(low)]
    out: list[Any] = []
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


def _number(schema: dict[str, Any], source: TokenSource, *, integer: bool) -> int | float:
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


def _bound(
    schema: dict[str, Any], inclusive: str, exclusive: str, *, up: bool, integer: bool
) -> float | None:
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


def _string(schema: dict[str, Any], source: TokenSource) -> str:
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in _FORMATS:
        return _FORMATS[fmt]
    low = _count(schema, "minLength")
    high = schema.get("maxLength")
    source.spend(0, low)  # refused before it is built
    words = [source.word()]
    length = len(words[0])
    while length < low:
        words.append(source.word())
        length += 1 + len(words[-1])
    text = " ".join(words)
    if isinstance(high, int) and len(text) > high:
        text = text[: max(high, 0)]
    source.spend(0, max(len(text) - low, 0))
    return text


def _count(schema: dict[str, Any], key: str) -> int:
    """A count keyword (``minItems``, ``minLength``, ``minProperties``) as the filler reads it:
    a number, else 0 (the validator then says what is wrong with the schema)."""
    value = schema.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return 0
    return math.ceil(value)


def _smallest(schema: Any) -> Any:
    """The least value of a schema's kind, where nesting is cut off."""
    kind = _kind(schema)
    return {"object": {}, "array": [], "integer": 0, "number": 0, "boolean": False, "null": None}.get(
        kind, ""
    )
