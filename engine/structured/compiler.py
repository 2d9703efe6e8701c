"""Compiling structured-output specifications with xgrammar, once each, off the step loop.

`compile_spec` turns a `StructuredOutput` into an `xgrammar.CompiledGrammar` for the model's
vocabulary. `GrammarCache` keeps compiled grammars by specification (least recently used out
past `max_entries`) and compiles new ones on a thread of its own, so a slow compile never
holds up the step loop: the request waits for its grammar while the others run, and
`on_ready` (the worker's wake-up) is called when a compile ends.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ipc.messages import StructuredOutput

logger = logging.getLogger(__name__)

_XGRAMMAR_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] [^\s:]+:\d+: ")  # xgrammar's "[time] file.cc:line: "
MAX_WHITESPACE = 16  # consecutive JSON whitespace characters allowed (an unbounded run is a trap for weak models)


class GrammarError(ValueError):
    """A specification that does not compile; the message says why."""


def choice_ebnf(choices: list[str]) -> str:
    """EBNF whose language is exactly `choices` (each a JSON-escaped string literal)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("'choice' must be a non-empty array of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def structural_tag_of(spec: str):
    """xgrammar's structural tag for a JSON text: the current form ({"type": "structural_tag",
    "format": ...}) as is; vLLM's legacy form ({"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}) converted."""
    import xgrammar as xgr

    try:
        tag = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"the structural tag is not valid JSON: {exc}") from None
    if isinstance(tag, dict) and "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                 for s in tag["structures"]]
        return ("legacy", items, list(tag.get("triggers", [])))
    return ("tag", spec, None)


def tool_call_tag(spec: str):
    """xgrammar's built-in structural tag for a model's tool-call markup (DeepSeek's DSML): the
    reasoning section first when the output starts in it, then the calls a tool choice forces."""
    import xgrammar as xgr

    t = json.loads(spec)
    return xgr.get_builtin_structural_tag(t["model"], tools=t["tools"], tool_choice=t["tool_choice"],
                                          reasoning=t["reasoning"], parallel_tool_calls=t["parallel_tool_calls"],
                                          max_whitespace_cnt=MAX_WHITESPACE)


def is_json(spec: StructuredOutput) -> bool:
    """Grammars whose output is JSON text (compiled against a vocabulary without raw control
    characters: engine/structured/vocab.py)."""
    return spec.kind in ("json", "json_object", "structural_tag")


def make_compiler(tokenizer_path, vocab_size: int, stop_token_ids: list[int], json_text: bool):
    import xgrammar as xgr

    from .vocab import tokenizer_info

    info = tokenizer_info(tokenizer_path, vocab_size, stop_token_ids, json_text=json_text)
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def compile_spec(compiler, spec: StructuredOutput):
    """The CompiledGrammar of `spec`; GrammarError when it does not compile."""
    import xgrammar as xgr

    try:
        if spec.kind == "json":
            return compiler.compile_json_schema(spec.spec, any_whitespace=spec.any_whitespace,
                                                max_whitespace_cnt=MAX_WHITESPACE if spec.any_whitespace else None)
        if spec.kind == "json_object":
            schema = '{"type": "object"}'
            return compiler.compile_json_schema(schema, any_whitespace=spec.any_whitespace, strict_mode=False,
                                                max_whitespace_cnt=MAX_WHITESPACE if spec.any_whitespace else None)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.spec)
        if spec.kind == "choice":
            return compiler.compile_grammar(choice_ebnf(json.loads(spec.spec)))
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.spec)
        if spec.kind == "tool_calls":
            return compiler.compile_structural_tag(tool_call_tag(spec.spec))
        form, tag, triggers = structural_tag_of(spec.spec)
        if form == "legacy":
            return compiler.compile_structural_tag(tag, triggers)
        return compiler.compile_structural_tag(tag)
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError, KeyError, xgr.InvalidJSONError, xgr.InvalidStructuralTagError) as exc:
        message = " ".join(_XGRAMMAR_PREFIX.sub("", str(exc)).split())[:500]
        raise GrammarError(f"the {spec.kind.replace('_', ' ')} specification does not compile: {message}") from None


class GrammarCache:
    """Compiled grammars by specification; compiles on one background thread. The vocabulary
    (and xgrammar itself, a few seconds to import) is loaded there too, at the first compile, so
    the step loop never waits for it."""

    def __init__(self, tokenizer_path, vocab_size: int, stop_token_ids: list[int], max_entries: int = 256,
                 on_ready: Callable[[], None] | None = None):
        self.tokenizer_path, self.vocab_size, self.stop_token_ids = tokenizer_path, vocab_size, list(stop_token_ids)
        self.max_entries = max_entries
        self.on_ready = on_ready
        self._compilers = {}  # JSON / other grammars → xgrammar.GrammarCompiler, made on the compile thread
        self._entries: OrderedDict[StructuredOutput, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.compiles = 0  # compiles started (a cache miss each)

    def get(self, spec: StructuredOutput) -> Future:
        """The compile of `spec`: done at once for a cached one, else running in the background.
        Its result is the CompiledGrammar, or it raises GrammarError."""
        key = StructuredOutput(spec.kind, spec.spec, spec.any_whitespace)  # start_after is the matcher's
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, key)
            self.compiles += 1
            self._entries[key] = future
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        if self.on_ready is not None:
            future.add_done_callback(lambda _: self.on_ready())
        return future

    def _compile(self, spec: StructuredOutput):
        json_text = is_json(spec)
        if json_text not in self._compilers:
            self._compilers[json_text] = make_compiler(self.tokenizer_path, self.vocab_size, self.stop_token_ids,
                                                       json_text)
        return compile_spec(self._compilers[json_text], spec)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
