"""schema_fill: arguments built from a model's tokens are valid for the tool's JSON schema,
whatever the tokens; the free choices follow the tokens; what it cannot honour is caught."""

from __future__ import annotations

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.engines.schema_fill import (
    MAX_VALUES,
    TokenSource,
    UnfillableSchema,
    conforms,
    fill_arguments,
    fill_schema,
)

SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    {
        "type": "object",
        "properties": {
            "unit": {"enum": ["c", "f"]},
            "n": {"type": "integer", "minimum": 3, "maximum": 5},
            "x": {"type": "number", "exclusiveMinimum": 0.5, "exclusiveMaximum": 10},
            "step": {"type": "integer", "multipleOf": 5, "minimum": 1},
            "ok": {"type": "boolean"},
            "none": {"type": "null"},
            "name": {"type": "string", "minLength": 12, "maxLength": 15},
            "when": {"type": "string", "format": "date-time"},
            "fixed": {"const": "yes"},
        },
        "required": ["unit", "n", "x", "step", "ok", "none", "name", "when", "fixed"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["a", "b", "c"]},
                "minItems": 2,
                "uniqueItems": True,
            },
            "pair": {
                "type": "array",
                "prefixItems": [{"type": "integer"}, {"type": "string"}],
                "minItems": 2,
            },
            "maybe": {"type": ["null", "integer"], "maximum": -3},
            "either": {
                "anyOf": [
                    {"type": "null"},
                    {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]},
                ]
            },
            "both": {
                "allOf": [
                    {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    {"required": ["b"], "properties": {"b": {"type": "boolean"}}},
                ]
            },
        },
        "required": ["tags", "pair", "maybe", "either", "both"],
    },
    {"type": "object", "minProperties": 2, "properties": {"a": {"type": "string"}, "b": {"type": "string"}}},
    {
        "type": "object",
        "properties": {"old": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1}},
        "required": ["old"],
        "$schema": "http://json-schema.org/draft-04/schema#",
    },
    {"type": "object", "properties": {"self": {"$ref": "#"}}},
]

tokens = st.lists(st.tuples(st.text(min_size=0, max_size=8), st.integers(0, 10_000)), max_size=20)


@settings(max_examples=60, deadline=None)
@given(tokens=tokens, index=st.integers(0, len(SCHEMAS) - 1))
def test_filled_arguments_are_valid_for_the_schema_whatever_the_tokens(tokens, index):
    schema = SCHEMAS[index]
    source = TokenSource([w for w, _ in tokens], [i for _, i in tokens])
    value = fill_schema(schema, source)
    jsonschema.validators.validator_for(schema)(schema).validate(value)
    assert conforms(value, schema) is None


def test_the_choices_follow_the_models_tokens():
    schema = SCHEMAS[1]
    first = fill_schema(schema, TokenSource(["Paris", "rain"], [0, 1, 2, 3]))
    second = fill_schema(schema, TokenSource(["Oslo", "snow"], [1, 2, 3, 4]))
    assert first != second
    assert fill_schema({"type": "string"}, TokenSource(["Paris."], [7])) == "Paris"  # punctuation off


def test_what_it_cannot_honour_is_reported_not_hidden():
    schema = {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"],
    }
    value = fill_schema(schema, TokenSource(["hello"], [1]))
    assert conforms(value, schema) is not None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(value, schema)


# --- the client's schema as hostile input ---------------------------------------------------


def _nested_arrays(levels: int, min_items: int) -> dict:
    inner: dict = {"type": "integer"}
    for _ in range(levels):
        inner = {"type": "array", "minItems": min_items, "items": inner}
    return {"type": "object", "properties": {"a": inner}, "required": ["a"]}


@pytest.mark.parametrize(
    "schema",
    [
        # Each was built in full before: a million items took 6.4 s on the engine's event
        # loop and 9 MB of arguments; a billion would take hours and gigabytes.
        {"type": "object", "properties": {"a": {"type": "array", "minItems": 10**9}}, "required": ["a"]},
        {"type": "object", "properties": {"a": {"type": "string", "minLength": 10**9}}, "required": ["a"]},
        _nested_arrays(6, 10),  # a million integers, ten at a time
        _nested_arrays(12, 10**9),  # past the nesting cut-off, still a billion
    ],
    ids=["min-items", "min-length", "nested", "past-the-cut-off"],
)
def test_a_schema_asking_for_more_than_a_call_may_hold_is_refused_before_it_is_built(schema):
    with pytest.raises(UnfillableSchema, match="more than a call's arguments may hold"):
        fill_arguments(schema, TokenSource(["word"], [1]))


def test_the_limits_still_leave_room_for_real_arguments():
    schema = {
        "type": "object",
        "properties": {"rows": {"type": "array", "minItems": MAX_VALUES - 2, "items": {"type": "integer"}}},
        "required": ["rows"],
    }
    value = fill_arguments(schema, TokenSource(["word"], [1]))
    assert len(value["rows"]) == MAX_VALUES - 2 and conforms(value, schema) is None


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number", "minimum": 1e300, "multipleOf": 1e-300},  # no float steps that far
        {"type": "integer", "minimum": 1e308, "maximum": 1.7e308, "multipleOf": 1e-320},
    ],
)
def test_numbers_no_float_reaches_are_unfillable_not_an_exception(schema):
    wrapped = {"type": "object", "properties": {"n": schema}, "required": ["n"]}
    with pytest.raises(UnfillableSchema, match="numbers"):
        fill_arguments(wrapped, TokenSource(["word"], [1]))


@pytest.mark.parametrize("key", ["minItems", "minLength", "minProperties"])
@pytest.mark.parametrize("odd", ["3", [], {}, None, True, -5])
def test_count_keywords_of_the_wrong_type_are_left_to_the_validator(key, odd):
    schema = {"type": "object", "properties": {"a": {"type": "string", key: odd}}, "required": ["a"]}
    value = fill_arguments(schema, TokenSource(["word"], [1]))
    assert isinstance(value["a"], str)


def test_a_pattern_that_backtracks_is_given_up_after_its_time_not_searched_for_minutes():
    # A pattern Python's re takes far longer over than regex (which the checks use), and one
    # that regex, in turn, backtracks on: each check is cut at its time, and says so.
    schema = {"type": "string", "pattern": r"^(\w|\s|[a-z])*[0-9]$"}
    problem = conforms("hello there " * 4, schema, pattern_time_s=0.05)
    assert problem is not None and "longer than 0.05 s" in problem
    # re alone: 0.17 s at 29 characters, sixteen times longer for every six more.
    schema = {"type": "string", "pattern": r"^(\w+\s?)*[!?]$"}
    assert "does not match" in conforms("hello there " * 20, schema)


@pytest.mark.parametrize(
    "schema, said",
    [
        ({"type": "string", "pattern": "("}, "is not a 'regex'"),
        ({"type": "object", "patternProperties": {"[": {}}}, "is not a 'regex'"),
        (
            {"type": "object", "patternProperties": {"^a": {}}, "unevaluatedProperties": False},
            "not checked",
        ),
    ],
)
def test_patterns_that_cannot_be_checked_say_so(schema, said):
    problem = conforms({"a": "b"} if schema["type"] == "object" else "text", schema)
    assert problem is not None and said in problem


_SAFE_PATTERNS = st.sampled_from(["^a", "b$", "[0-9]", "^x.*y$", "a|1", "^$", "(ab)+"])
_TEXT = st.text(alphabet="abxy01", max_size=5)


@st.composite
def _pattern_schemas(draw):
    schema: dict = {"type": "object"}
    if draw(st.booleans()):
        schema["properties"] = {
            k: {"type": "string", "pattern": draw(_SAFE_PATTERNS)} for k in draw(st.lists(_TEXT, max_size=3))
        }
    if draw(st.booleans()):
        schema["patternProperties"] = {
            draw(_SAFE_PATTERNS): {"type": "string", "pattern": draw(_SAFE_PATTERNS)}
        }
    choice = draw(st.sampled_from(["absent", "false", "schema"]))
    if choice == "false":
        schema["additionalProperties"] = False
    elif choice == "schema":
        schema["additionalProperties"] = {"type": "string", "pattern": draw(_SAFE_PATTERNS)}
    return schema


@settings(max_examples=300, deadline=None)
@given(schema=_pattern_schemas(), value=st.dictionaries(_TEXT, _TEXT, max_size=4))
def test_the_time_bounded_pattern_rules_agree_with_jsonschemas_own(schema, value):
    expected = jsonschema.validators.validator_for(schema)(schema).is_valid(value)
    assert (conforms(value, schema) is None) == expected


_KEYWORDS = st.sampled_from(
    [
        "type", "properties", "required", "items", "prefixItems", "additionalItems", "minItems",
        "maxItems", "uniqueItems", "enum", "const", "anyOf", "oneOf", "allOf", "minimum",
        "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
        "maxLength", "format", "minProperties", "pattern",
    ]
)  # fmt: skip
_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null", "a"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(_KEYWORDS | st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=16,
)


@settings(max_examples=300, deadline=None)
@given(schema=st.dictionaries(_KEYWORDS, _VALUES, max_size=6))
def test_any_schema_a_client_sends_is_filled_or_unfillable_never_an_exception(schema):
    try:
        value = fill_arguments(schema, TokenSource(["word", "other"], [3, 7]))
    except UnfillableSchema:
        return
    problem = conforms(value, schema)
    assert problem is None or isinstance(problem, str)
