"""The OpenAPI 3 description of ringserve's HTTP API (served at /openapi.json; used for fuzzing).

Numeric limits of the sampling fields come from the wire type (`ipc.messages.SamplingParams`),
the same limits the server enforces, so a fuzzer's out-of-range values probe exactly them.
"""

from __future__ import annotations

import msgspec.inspect

from ipc.messages import SamplingParams


def _wire_bounds() -> dict[str, dict]:
    """Per SamplingParams field: its JSON-schema bounds (minimum / maximum / maxItems / items)."""
    def bounds(t) -> dict:
        if isinstance(t, msgspec.inspect.UnionType):
            t = next(x for x in t.types if not isinstance(x, msgspec.inspect.NoneType))
        if isinstance(t, msgspec.inspect.VarTupleType):
            return {"maxItems": t.max_length, "items": {"type": "integer", **bounds(t.item_type)}}
        out = {}
        for ours, theirs in (("ge", "minimum"), ("le", "maximum")):
            if getattr(t, ours, None) is not None:
                out[theirs] = getattr(t, ours)
        return out
    return {f.name: bounds(f.type) for f in msgspec.inspect.type_info(SamplingParams).fields}


_WIRE = _wire_bounds()

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
    "max_tokens": {"type": ["integer", "null"], **_WIRE["max_tokens"]},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},  # OpenAI's range, inside the wire's
    "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    "top_k": {"type": ["integer", "null"], **_WIRE["top_k"], "minimum": -1},  # -1 = disabled, as vLLM
    "min_p": {"type": ["number", "null"], **_WIRE["min_p"]},
    "presence_penalty": {"type": ["number", "null"], **_WIRE["presence_penalty"]},
    "frequency_penalty": {"type": ["number", "null"], **_WIRE["frequency_penalty"]},
    "seed": {"type": ["integer", "null"], **_WIRE["seed"]},
    "stop_token_ids": {"type": ["array", "null"], **_WIRE["stop_token_ids"]},
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
                                 "logprobs": {"type": ["integer", "null"], **_WIRE["logprobs"]},
                                 "echo": {"type": ["boolean", "null"]},
                                 "prompt_logprobs": {"type": ["integer", "null"], **_WIRE["prompt_logprobs"]},
                                 **_SAMPLING,
                                 # 0 = score the prompt only (the engine's own minimum is 1)
                                 "max_tokens": {"type": ["integer", "null"], **_WIRE["max_tokens"], "minimum": 0}}}
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant"]},
                              "content": {"type": "string"}}}
    chat = {"type": "object", "required": ["messages"],
            "properties": {"model": {"type": "string", "enum": list(state.served_names)},
                           "messages": {"type": "array", "items": message, "minItems": 1},
                           "logprobs": {"type": ["boolean", "null"]},
                           "top_logprobs": {"type": ["integer", "null"], **_WIRE["logprobs"]},
                           "max_completion_tokens": {"type": ["integer", "null"], **_WIRE["max_tokens"]},
                           **_SAMPLING}}
    anthropic_message = {"type": "object", "required": ["role", "content"],
                         "properties": {"role": {"type": "string", "enum": ["user", "assistant"]},
                                        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
                                            "type": "object", "required": ["type"],
                                            "properties": {"type": {"type": "string"}}}}]}}}
    anthropic_tool = {"type": "object", "required": ["name", "input_schema"],
                      "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                                     "input_schema": {"type": "object"}}}
    anthropic_chat = {"model": {"type": "string", "enum": list(state.served_names)},
                      "messages": {"type": "array", "items": anthropic_message, "minItems": 1},
                      "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
                      "tools": {"type": "array", "items": anthropic_tool},
                      "tool_choice": {"type": "object", "required": ["type"], "properties": {
                          "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]},
                          "name": {"type": "string"}}},
                      "thinking": {"type": "object", "required": ["type"], "properties": {
                          "type": {"type": "string", "enum": ["enabled", "disabled", "adaptive"]},
                          "budget_tokens": {"type": "integer", "minimum": 1}}}}
    messages = {"type": "object", "required": ["messages", "max_tokens"],
                "properties": {**anthropic_chat,
                               "max_tokens": {"type": "integer", **_WIRE["max_tokens"]},
                               "stop_sequences": {"type": "array", "items": {"type": "string"}, "maxItems": 16},
                               "temperature": _SAMPLING["temperature"], "top_p": _SAMPLING["top_p"],
                               "top_k": _SAMPLING["top_k"], "stream": {"type": "boolean"},
                               "metadata": {"type": "object", "properties": {"user_id": {"type": "string"}}},
                               "output_config": {"type": "object", "properties": {"effort": {
                                   "type": "string", "enum": ["low", "medium", "high", "xhigh", "max"]}}}}}
    responses = {"type": "object", "required": ["input"],
                 "properties": {"model": {"type": "string", "enum": list(state.served_names)},
                                "input": {"oneOf": [{"type": "string", "minLength": 1},
                                                    {"type": "array", "minItems": 1, "items": {"type": "object"}}]},
                                "instructions": {"type": ["string", "null"]},
                                "max_output_tokens": {"type": ["integer", "null"], **_WIRE["max_tokens"]},
                                "temperature": _SAMPLING["temperature"], "top_p": _SAMPLING["top_p"],
                                "stream": {"type": ["boolean", "null"]},
                                "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"],
                                                                     "properties": {"type": {"enum": ["function"]},
                                                                                    "name": {"type": "string"},
                                                                                    "parameters": {"type": "object"}}}},
                                "tool_choice": {"oneOf": [{"type": "string", "enum": ["auto", "none", "required"]},
                                                          {"type": "object"}]},
                                "reasoning": {"type": ["object", "null"], "properties": {"effort": {
                                    "type": "string",
                                    "enum": ["none", "minimal", "low", "medium", "high", "xhigh", "max"]}}},
                                "store": {"type": ["boolean", "null"]}}}
    simple = {"get": {"responses": {"200": {"description": "OK"}, "503": {"description": "unavailable"}}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "ringserve", "version": state.version},
        "paths": {
            "/v1/completions": _post("text completion", completion),
            "/v1/chat/completions": _post("chat completion", chat),
            "/v1/messages": _post("Anthropic Messages", messages),
            "/v1/messages/count_tokens": _post("Anthropic Messages token count", {
                "type": "object", "required": ["messages"], "properties": anthropic_chat}),
            "/v1/responses": _post("OpenAI Responses (stateless)", responses),
            "/tokenize": _post("tokenize", {"type": "object", "properties": {"prompt": {"type": "string"}}}),
            "/detokenize": _post("detokenize", {"type": "object", "required": ["tokens"], "properties": {
                "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}),
            "/v1/models": {"get": {"responses": {"200": {"description": "OK"}}}},
            "/version": {"get": {"responses": {"200": {"description": "OK"}}}},
            "/health": simple,
            "/ready": simple,
        },
    }
