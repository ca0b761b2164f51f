"""schema_fill: arguments built from a model's tokens are valid for the tool's JSON schema,
whatever the tokens; the free choices follow the tokens; what it cannot honour is caught."""

from __future__ import annotations

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.engines.schema_fill import TokenSource, conforms, fill_schema

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
