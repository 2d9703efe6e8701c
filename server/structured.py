"""Structured outputs at the edge: the request fields (as vLLM spells them) → `StructuredOutput`,
and a compile check with a time limit before a request reaches a worker.

Fields: `response_format` {"type": "json_object"} | {"type": "json_schema", "json_schema":
{"name", "schema", "strict"}} | {"type": "structural_tag", ...}; vLLM's `structured_outputs`
{"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag": ..., plus
"disable_any_whitespace"}. One grammar per request. JSON Schemas are checked against their
meta-schema (`jsonschema`) and for keywords xgrammar does not enforce.

`GrammarChecker` compiles every new specification once, in a helper process of its own
against the model's vocabulary, with a deadline: a specification that fails is a 400 naming the
problem; one that takes longer (a pathological regex or schema) is a 400 after the deadline, and
the helper is killed and replaced — never a stuck worker or event loop. Results are cached, so a
repeated specification costs nothing. The workers then compile the same specification knowing it
compiles within the deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ipc.messages import StructuredOutput

from .errors import ProtocolError

logger = logging.getLogger(__name__)

# Keywords a JSON Schema may use that xgrammar's JSON Schema converter does not enforce: output
# would pass the grammar and fail the schema, so such a schema is refused (as vLLM refuses them).
UNENFORCED_KEYWORDS = ("allOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                       "propertyNames", "contains", "minContains", "maxContains", "unevaluatedItems",
                       "$dynamicRef", "$recursiveRef")
MAX_SCHEMA_DEPTH = 64
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredLimits:
    max_chars: int = 256 << 10  # one specification (schema text, regex, EBNF, choices)
    max_choices: int = 1024
    compile_timeout_s: float = 10.0


def parse_structured(body: dict, limits: StructuredLimits = StructuredLimits()) -> StructuredOutput | None:
    """The request's grammar from `response_format` / `structured_outputs`, or None."""
    fmt, so = body.get("response_format"), body.get("structured_outputs")
    from_format = _from_response_format(fmt, limits) if fmt is not None else None
    from_so = _from_structured_outputs(so, limits) if so is not None else None
    if from_format is not None and from_so is not None:
        raise ProtocolError("'response_format' and 'structured_outputs' both ask for a grammar; give one",
                            "structured_outputs", "invalid_value")
    spec = from_format or from_so
    if spec is not None and len(spec.spec) > limits.max_chars:
        raise ProtocolError(f"the structured output specification is {len(spec.spec)} characters; at most "
                            f"{limits.max_chars} are accepted", "structured_outputs", "too_long")
    return spec


def _from_response_format(fmt: Any, limits: StructuredLimits) -> StructuredOutput | None:
    if not isinstance(fmt, dict):
        raise ProtocolError("'response_format' must be an object", "response_format", "invalid_type")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict):
            raise ProtocolError("'response_format.json_schema' must be an object with a 'schema'",
                                "response_format", "invalid_value")
        schema = inner.get("schema", {"type": "object"})  # OpenAI: the schema may be omitted
        return StructuredOutput("json", _schema_text(schema, "response_format.json_schema.schema", limits))
    if kind == "structural_tag":
        return StructuredOutput("structural_tag", json.dumps(fmt, ensure_ascii=False))
    raise ProtocolError(f"'response_format.type' must be text, json_object, json_schema or structural_tag, "
                        f"got {kind!r}", "response_format", "invalid_value")


def _from_structured_outputs(so: Any, limits: StructuredLimits) -> StructuredOutput | None:
    if not isinstance(so, dict):
        raise ProtocolError("'structured_outputs' must be an object", "structured_outputs", "invalid_type")
    if so.get("whitespace_pattern") is not None:
        raise ProtocolError("'structured_outputs.whitespace_pattern' is not supported (xgrammar has no such option; "
                            "use disable_any_whitespace)", "structured_outputs", "unsupported")
    given = [k for k in _KINDS if so.get(k) not in (None, False)]
    if not given:
        return None
    if len(given) > 1:
        raise ProtocolError(f"'structured_outputs' gives {' and '.join(given)}; give exactly one", "structured_outputs",
                            "invalid_value")
    kind, value = given[0], so[given[0]]
    whitespace = not bool(so.get("disable_any_whitespace", False))
    if kind == "json":
        return StructuredOutput("json", _schema_text(value, "structured_outputs.json", limits), whitespace)
    if kind == "json_object":
        return StructuredOutput("json_object", "", whitespace)
    if kind == "choice":
        if (not isinstance(value, list) or not value or len(value) > limits.max_choices
                or not all(isinstance(c, str) and c for c in value)):
            raise ProtocolError(f"'structured_outputs.choice' must be 1 to {limits.max_choices} non-empty strings",
                                "structured_outputs", "invalid_value")
        return StructuredOutput("choice", json.dumps(value, ensure_ascii=False))
    if kind == "structural_tag" and isinstance(value, dict):
        value = json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"'structured_outputs.{kind}' must be a non-empty string", "structured_outputs",
                            "invalid_value")
    return StructuredOutput(kind, value)


def _schema_text(schema: Any, where: str, limits: StructuredLimits) -> str:
    """A JSON Schema (object, or its JSON text) checked and as canonical JSON text."""
    if isinstance(schema, str):
        if len(schema) > limits.max_chars:
            raise ProtocolError(f"'{where}' is {len(schema)} characters; at most {limits.max_chars} are accepted",
                                "structured_outputs", "too_long")
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ProtocolError(f"'{where}' is not valid JSON: {exc}", "structured_outputs", "invalid_value") from None
    if not isinstance(schema, (dict, bool)):
        raise ProtocolError(f"'{where}' must be a JSON Schema object", "structured_outputs", "invalid_value")
    check_schema(schema, where)
    return json.dumps(schema, ensure_ascii=False)  # key order kept: it is the properties' order in the output


def check_schema(schema: dict | bool, where: str, enforced: bool = True, param: str = "structured_outputs") -> None:
    """The schema is valid against its meta-schema and (`enforced`: a grammar will be made of
    it) uses only keywords xgrammar enforces. Errors name `param`, the request field holding it."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path)
        raise ProtocolError(f"'{where}' is not a valid JSON Schema: {exc.message}" + (f" (at {path})" if path else ""),
                            param, "invalid_value") from None
    except RecursionError:
        raise ProtocolError(f"'{where}' is nested too deeply", param, "invalid_value") from None
    bad = sorted(set(_unenforced(schema, 0, param)))
    if bad and enforced:
        raise ProtocolError(f"'{where}' uses JSON Schema keywords structured outputs cannot enforce: {', '.join(bad)}",
                            param, "unsupported")


def _unenforced(node: Any, depth: int, param: str):
    if depth > MAX_SCHEMA_DEPTH:
        raise ProtocolError(f"the JSON Schema is nested more than {MAX_SCHEMA_DEPTH} levels deep", param,
                            "invalid_value")
    if isinstance(node, dict):
        for key, value in node.items():
            if key in UNENFORCED_KEYWORDS or (key == "uniqueItems" and value is True):
                yield key
            if key not in ("enum", "const", "examples", "default"):  # values there are data, not schemas
                yield from _unenforced(value, depth + 1, param)
    elif isinstance(node, list):
        for item in node:
            yield from _unenforced(item, depth + 1, param)


# ---- the compile check ---------------------------------------------------------------------------


def _checker_main(conn, tokenizer_path: str, vocab_size: int, stop_ids: list[int]) -> None:
    """The helper process: compile each specification it is sent (JSON in, JSON out: never serialized Python objects),
    as the workers will (engine/structured/compiler.py)."""
    from engine.structured.compiler import GrammarError, compile_spec, is_json, make_compiler

    compilers = {json_text: make_compiler(tokenizer_path, vocab_size, stop_ids, json_text) for json_text in (False, True)}
    conn.send_bytes(b'{"ready": true}')
    while True:
        try:
            raw = conn.recv_bytes()
        except EOFError:
            return
        msg = json.loads(raw)
        try:
            spec = StructuredOutput(msg["kind"], msg["spec"], msg["any_whitespace"])
            compile_spec(compilers[is_json(spec)], spec)
            reply = {"ok": True}
        except GrammarError as exc:
            reply = {"error": str(exc)}
        conn.send_bytes(json.dumps(reply).encode())


class GrammarChecker:
    """Compiles specifications in a helper process with a deadline (see the module docstring)."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_ids: list[int],
                 limits: StructuredLimits = StructuredLimits(), start_timeout_s: float = 120.0, cache_size: int = 1024):
        self.args = (str(tokenizer_path), vocab_size, list(stop_ids))
        self.limits, self.start_timeout_s = limits, start_timeout_s
        self._proc = self._conn = None
        self._lock = asyncio.Lock()
        self._results: OrderedDict[StructuredOutput, str | None] = OrderedDict()  # spec → error (None: compiles)
        self.cache_size = cache_size
        self.timeouts = 0

    async def check(self, spec: StructuredOutput) -> None:
        """ProtocolError (400) when `spec` does not compile for this model within the deadline."""
        key = StructuredOutput(spec.kind, spec.spec, spec.any_whitespace)
        if key not in self._results:
            async with self._lock:
                if key not in self._results:
                    self._remember(key, await asyncio.get_running_loop().run_in_executor(None, self._compile, key))
        self._results.move_to_end(key)
        error = self._results[key]
        if error is not None:
            raise ProtocolError(error, "structured_outputs", "invalid_value")

    def _remember(self, key: StructuredOutput, error: str | None) -> None:
        self._results[key] = error
        while len(self._results) > self.cache_size:
            self._results.popitem(last=False)

    def _compile(self, spec: StructuredOutput) -> str | None:
        """Runs on an executor thread: the helper's verdict, or the timeout's."""
        conn = self._helper()
        conn.send_bytes(json.dumps({"kind": spec.kind, "spec": spec.spec,
                                    "any_whitespace": spec.any_whitespace}).encode())
        if not conn.poll(self.limits.compile_timeout_s):
            self.timeouts += 1
            logger.warning("a %s specification did not compile within %.0f s: refused; restarting the checker",
                           spec.kind, self.limits.compile_timeout_s)
            self.close()
            return (f"the {spec.kind.replace('_', ' ')} specification did not compile within "
                    f"{self.limits.compile_timeout_s:g} s; simplify it")
        reply = json.loads(conn.recv_bytes())
        return reply.get("error")

    def _helper(self):
        if self._proc is not None and self._proc.is_alive():
            return self._conn
        self.close()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_checker_main, args=(child, *self.args), name="ringserve-grammar-check", daemon=True)
        proc.start()
        child.close()
        if not parent.poll(self.start_timeout_s):
            proc.kill()
            raise RuntimeError("the grammar checker did not start")
        parent.recv_bytes()
        self._proc, self._conn = proc, parent
        return parent

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
        self._proc = self._conn = None
