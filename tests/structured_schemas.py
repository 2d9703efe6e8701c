"""JSON Schemas for the structured-output tests: every kind of constraint users send (nested
objects, arrays with min/max items, enums, anyOf/oneOf, $ref/$defs and recursion, string
patterns, lengths and formats, numbers with bounds, const, null, booleans, tuples). Strings,
arrays and numbers are bounded so that a random-weight model, sampling among whatever the
grammar allows, ends its output within the tests' token budgets."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 8}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}

SCHEMAS: dict[str, dict] = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "name": NAME},
                 "required": ["id", "name"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "array_bounds": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 2, "maxItems": 4}},
        "required": ["tags"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
             "required": ["color", "size"]},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [DIGIT, {"type": "string", "maxLength": 4},
                                                                   {"type": "null"}]}}, "required": ["value"]},
    "ref_defs": {"type": "object", "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"type": "integer", "minimum": -50, "maximum": 50}},
        "required": ["x", "y"]}},
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}, "required": ["a", "b"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"}},
                "required": ["code"]},
    "number_bounds": {"type": "object", "properties": {
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "temp": {"type": "number", "exclusiveMinimum": -10, "exclusiveMaximum": 40}}, "required": ["ratio", "temp"]},
    "const": {"type": "object", "properties": {"version": {"const": "v1"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 3}},
              "required": ["version", "n"]},
    "array_of_objects": {"type": "array", "items": {"type": "object", "properties": {
        "k": {"type": "string", "maxLength": 3}, "v": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["k", "v"]}, "minItems": 1, "maxItems": 3},
    "optional": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5}, "b": NAME},
                 "required": ["a"]},
    "nullable": {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 6}},
                 "required": ["note"]},
    "boolean_array": {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"},
                                                                 "minItems": 1, "maxItems": 5}}, "required": ["flags"]},
    "deep": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "object", "properties": {"d": DIGIT}, "required": ["d"]}}, "required": ["c"]}}, "required": ["b"]}},
        "required": ["a"]},
    "tuple": {"type": "array", "prefixItems": [DIGIT, NAME, {"type": "boolean"}], "items": False, "minItems": 3},
    "one_of": {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": DIGIT}, "required": ["kind", "r"]},
        {"type": "object", "properties": {"kind": {"const": "square"}, "s": DIGIT}, "required": ["kind", "s"]}]}},
        "required": ["shape"]},
    "string_length": {"type": "object", "properties": {"id": {"type": "string", "minLength": 4, "maxLength": 4}},
                      "required": ["id"]},
    "date_format": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    "integer_list": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 3,
                     "maxItems": 3},
    "recursive": {"type": "object", "$defs": {"node": {"type": "object", "properties": {
        "v": DIGIT, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["v", "next"]}},
        "properties": {"head": {"$ref": "#/$defs/node"}}, "required": ["head"]},
    "mixed": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 6}, "count": {"type": "integer", "minimum": 0, "maximum": 50},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10}, "maxItems": 2},
        "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
        "required": ["title", "count", "scores", "meta"]},
}
