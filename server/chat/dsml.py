"""DSML, the markup DeepSeek-V4 / V4.1 write tool calls in: rendering calls into a prompt, turning
parsed parameters into an OpenAI `arguments` string, and reading one `invoke` element from a
growing text for the streaming parser.

The grammar (V4 spelling; V4.1 writes `<｜DSML｜ calls>`, `<｜DSML｜ invoke`, `<｜DSML｜ parameter`):

    \\n\\n<｜DSML｜tool_calls>\\n
    <｜DSML｜invoke name="NAME">\\n
    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>\\n   (zero or more)
    </｜DSML｜invoke>\\n                                                         (one or more invokes)
    </｜DSML｜tool_calls>

Rendering (official `encode_arguments_to_dsml`): a string value is written raw with
`string="true"`; any other JSON value as `json.dumps(value, ensure_ascii=False)` with
`string="false"`. Keys and values are not escaped. Arguments that are not a JSON object: V4 wraps
a non-JSON string (or a non-string such as a dict) as one parameter named `arguments` and refuses
JSON that is not an object (its encoder crashes on it); V4.1 also takes a dict, decodes a
double-encoded JSON string, and wraps anything else as `arguments`.

Parsing (official `decode_dsml_to_arguments`): the arguments string is
`{"KEY": VALUE, ...}` with `json.dumps(key)`, a `string="true"` value JSON-escaped and a
`string="false"` value copied verbatim (so `400.0` stays `400.0`). The parser does not consult
the tool's JSON schema; neither do vLLM's nor SGLang's DeepSeek-V4 parsers for `string="true"`
values, so a string stays a string. With `repair=True` (serving) a `string="false"` value that is
not valid JSON becomes a JSON string instead, so `arguments` always parses.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from server.chat.deepseek_format import DSML, DsmlTags
from server.chat.deepseek_messages import EncodingError, ToolCallIn

# The official parser's patterns (its `$` also matches before one final newline).
HEADER_STRICT = re.compile(r'^\s*name="(.*?)">\n$', re.DOTALL)
PARAM_STRICT = re.compile(r'^ name="(.*?)" string="(true|false)">(.*?)<$', re.DOTALL)
# The serving parser also takes any whitespace where the official one wants exactly one space or
# newline; it tries the official pattern first so both read a well-formed element alike.
HEADER_LENIENT = re.compile(r'\s*name="(.*?)"\s*>\s*\Z', re.DOTALL)
PARAM_LENIENT = re.compile(r'\s+name="(.*?)"\s+string="(true|false)"\s*>(.*?)<\s*\Z', re.DOTALL)
GAP_LENIENT = re.compile(r">\s*\Z")


def to_json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise EncodingError(f"value is not JSON-serialisable: {exc}") from None


def arguments_to_parameters(arguments: Any, version: str) -> dict:
    """A tool call's `arguments` as the parameter dict the DSML is written from."""
    if version == "v4":
        if not isinstance(arguments, str):
            return {"arguments": arguments}
        try:
            decoded = json.loads(arguments)
        except (ValueError, RecursionError):
            return {"arguments": arguments}
        if not isinstance(decoded, dict):
            raise EncodingError("tool call arguments must be a JSON object (DeepSeek-V4)")
        return decoded
    decoded = arguments
    for _ in range(2):  # V4.1 tolerates double-encoded JSON
        if not isinstance(decoded, str):
            break
        try:
            decoded = json.loads(decoded)
        except (ValueError, RecursionError):
            break
    return decoded if isinstance(decoded, dict) else {"arguments": arguments}


def render_tool_calls(calls: list[ToolCallIn], tags: DsmlTags, version: str) -> str:
    """The `\\n\\n<｜DSML｜tool_calls>...` block that ends an assistant turn with tool calls."""
    invokes = []
    for call in calls:
        params = []
        for key, value in arguments_to_parameters(call.arguments, version).items():
            is_string = isinstance(value, str)
            params.append(
                f'{tags.parameter_open} name="{key}" string="{"true" if is_string else "false"}">'
                f"{value if is_string else to_json(value)}{tags.parameter_close}"
            )
        invokes.append(f'{tags.invoke_open} name="{call.name}">\n' + "\n".join(params)
                       + f"\n{tags.invoke_close}")
    return f"\n\n{tags.block_open}\n" + "\n".join(invokes) + f"\n{tags.block_close}"


def _is_json(text: str) -> bool:
    def reject(constant: str) -> None:
        raise ValueError(constant)  # NaN / Infinity are not JSON

    try:
        json.loads(text, parse_constant=reject)
    except (ValueError, RecursionError):
        return False
    return True


def parameters_to_arguments(params: list[tuple[str, str, bool]], *, repair: bool) -> str:
    """`{"KEY": VALUE, ...}` from (key, raw value, string="true") triples, as DeepSeek builds it."""
    items = []
    for key, value, is_string in params:
        if is_string or (repair and not _is_json(value)):
            value = json.dumps(value, ensure_ascii=False)
        items.append(f"{json.dumps(key, ensure_ascii=False)}: {value}")
    return "{" + ", ".join(items) + "}"


def _earliest(text: str, start: int, stops: tuple[str, ...]) -> tuple[int, str | None]:
    """Position and value of the first of `stops` found in text[start:] (-1, None if none)."""
    best, found = -1, None
    for stop in stops:
        pos = text.find(stop, start)
        if pos != -1 and (best == -1 or pos < best):
            best, found = pos, stop
    return best, found


INCOMPLETE, MALFORMED, COMPLETE = "incomplete", "malformed", "complete"


@dataclass
class InvokeScanner:
    """Reads one invoke element of a text that only grows, resuming where it stopped.

    Every decision is taken on a complete stop tag (or at `final`), so the outcome does not
    depend on how the text was split into chunks. `end` is the offset just past the element's
    closing `>` once COMPLETE.
    """

    tags: DsmlTags
    pos: int  # start of the segment being read (just after the last stop tag)
    stage: str = "header"  # header -> (param -> gap)* -> close
    name: str = ""
    params: list[tuple[str, str, bool]] = field(default_factory=list)
    end: int = -1
    _search_from: int = -1

    @classmethod
    def at(cls, tags: DsmlTags, start: int) -> "InvokeScanner":
        """A scanner for the invoke whose `<｜DSML｜invoke` tag begins at `start`."""
        pos = start + len(tags.invoke_open)
        return cls(tags=tags, pos=pos, _search_from=pos)

    def _stops(self) -> tuple[str, ...]:
        if self.stage == "param":
            return (f"/{DSML}{self.tags.parameter}",)
        return (self.tags.parameter_open, self.tags.invoke_close[:-1])

    def advance(self, text: str, final: bool) -> str:
        while True:
            if self.stage == "close":
                if self.pos >= len(text):
                    return MALFORMED if final else INCOMPLETE
                if text[self.pos] != ">":
                    return MALFORMED
                self.end = self.pos + 1
                return COMPLETE
            stops = self._stops()
            at, stop = _earliest(text, self._search_from, stops)
            if stop is None:
                if final:
                    return MALFORMED
                longest = max(len(s) for s in stops)
                self._search_from = max(self.pos, len(text) - longest + 1)
                return INCOMPLETE
            segment = text[self.pos:at]
            self.pos = self._search_from = at + len(stop)
            if not self._take(segment, stop):
                return MALFORMED

    def _take(self, segment: str, stop: str) -> bool:
        """Checks one segment; False when it is malformed."""
        if self.stage == "header":
            match = HEADER_STRICT.match(segment) or HEADER_LENIENT.match(segment)
            if match is None:
                return False
            self.name = match.group(1)
        elif self.stage == "param":
            match = PARAM_STRICT.match(segment) or PARAM_LENIENT.match(segment)
            if match is None or any(match.group(1) == p[0] for p in self.params):
                return False  # the official parser refuses a repeated parameter too
            self.params.append((match.group(1), match.group(3), match.group(2) == "true"))
            self.stage = "gap"
            return True
        elif segment != ">\n" and GAP_LENIENT.match(segment) is None:
            return False
        self.stage = "param" if stop == self.tags.parameter_open else "close"
        return True
