"""The OpenAPI 3 description of ringserve's HTTP API (served at /openapi.json; used for fuzzing)."""

from __future__ import annotations

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"],
                             "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                            "param": {"type": ["string", "null"]},
                                            "code": {"type": ["string", "null"]}}}},
}
_ERRORS = {str(code): {"description": text, "content": {"application/json": {"schema": _ERROR}}}
           for code, text in ((400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model"),
                              (413, "body too large"), (429, "overloaded"), (503, "draining or worker dead"))}

_SAMPLING = {
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    "top_k": {"type": ["integer", "null"], "minimum": -1},
    "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "seed": {"type": ["integer", "null"]},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 16},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 16},
                       {"type": "null"}]},
    "stream": {"type": ["boolean", "null"]},
    "user": {"type": ["string", "null"]},
    "ignore_eos": {"type": ["boolean", "null"]},
}


def _post(summary: str, schema: dict) -> dict:
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                     "responses": {"200": {"description": "OK"}, **_ERRORS}}}


def openapi_spec(state) -> dict:
    completion = {"type": "object", "required": ["prompt"],
                  "properties": {"model": {"type": "string", "enum": list(state.served_names)},
                                 "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                                                      {"type": "array", "items": {"type": "integer", "minimum": 0},
                                                       "minItems": 1}]},
                                 "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
                                 "echo": {"type": ["boolean", "null"]}, **_SAMPLING}}
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant"]},
                              "content": {"type": "string"}}}
    chat = {"type": "object", "required": ["messages"],
            "properties": {"model": {"type": "string", "enum": list(state.served_names)},
                           "messages": {"type": "array", "items": message, "minItems": 1},
                           "logprobs": {"type": ["boolean", "null"]},
                           "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
                           "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1}, **_SAMPLING}}
    simple = {"get": {"responses": {"200": {"description": "OK"}, "503": {"description": "unavailable"}}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "ringserve", "version": state.version},
        "paths": {
            "/v1/completions": _post("text completion", completion),
            "/v1/chat/completions": _post("chat completion", chat),
            "/tokenize": _post("tokenize", {"type": "object", "properties": {"prompt": {"type": "string"}}}),
            "/detokenize": _post("detokenize", {"type": "object", "required": ["tokens"], "properties": {
                "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}),
            "/v1/models": {"get": {"responses": {"200": {"description": "OK"}}}},
            "/version": {"get": {"responses": {"200": {"description": "OK"}}}},
            "/health": simple,
            "/ready": simple,
        },
    }
