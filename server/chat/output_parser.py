"""The serving-side reader of DeepSeek-V4 / V4.1 output: one streaming processor that turns
detokenized text deltas (special tokens kept as text) into reasoning, content and tool-call
events, for every API (chat completions, Messages, Responses) alike.

The text starts right after the generation prompt (`generation_suffix`): inside the reasoning in
thinking mode, inside the content in chat mode. The rules:
- Every EOS token text (`<｜end▁of▁sentence｜>`) is removed wherever it appears; text after it
  (`ignore_eos`) continues in the current section.
- Thinking mode: reasoning runs to the first `</think>`; a completion cut before it (max_tokens,
  a stop string) is all reasoning.
- Content runs to a tool block, `<｜DSML｜tool_calls>` (V4.1 `<｜DSML｜ calls>`); the blank line
  in front of it is not content (DeepSeek writes `\\n\\n` before the block). After the block
  closes, content resumes; a second block is read too.
- A tool block is read invoke by invoke (`dsml.InvokeScanner`: DeepSeek's grammar, any
  whitespace between elements). A call is emitted, as ToolCallStart then one
  ToolCallArgumentsDelta with its whole arguments, only once its invoke is complete and well
  formed, so a call never has to be taken back (SGLang's DeepSeek detectors also emit whole
  invokes). A malformed or truncated invoke is not a call: the text from it on comes back as
  content (with the block's opening tag when no call of that block was complete) and is read
  again as content.
- Nothing is emitted that a later character could turn into markup: a suffix that may begin
  `</think>`, the tool block opener (with its blank line) or EOS is held back until decided.

So for any chunking of the same text the events carry the same text, and their concatenation
equals the final message, which `parse_completion_lenient` returns for the whole text at once. On
every completion DeepSeek's parser accepts, the final message equals `parse_completion`'s (plus
call ids), except a tool block truncated at an element boundary, which DeepSeek's parser accepts
and this one returns as content, and a `string="false"` value that is not JSON, which becomes a
JSON string here so that `arguments` always parses.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Callable, Union

from server.chat import deepseek_format as fmt
from server.chat.dsml import COMPLETE, INCOMPLETE, InvokeScanner, parameters_to_arguments


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int  # 0-based over the whole completion
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgumentsDelta:
    index: int
    arguments: str  # a piece of the JSON arguments string; pieces concatenate to the whole


@dataclass(frozen=True, slots=True)
class MessageDone:
    """Last event of `finish()`: the final message and whether it calls tools."""

    message: dict[str, Any]
    tools_called: bool


OutputEvent = Union[ReasoningDelta, ContentDelta, ToolCallStart, ToolCallArgumentsDelta,
                    MessageDone]


def new_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _held_length(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


class _TokenRemover:
    """Removes every occurrence of one token from a text that arrives in pieces."""

    def __init__(self, token: str) -> None:
        self.token, self.pending = token, ""

    def feed(self, text: str, final: bool) -> str:
        text, kept, start = self.pending + text, [], 0
        while (at := text.find(self.token, start)) != -1:
            kept.append(text[start:at])
            start = at + len(self.token)
        rest = text[start:]
        hold = 0 if final else _held_length(rest, self.token)
        kept.append(rest[: len(rest) - hold])
        self.pending = rest[len(rest) - hold:]
        return "".join(kept)


class DeepSeekOutputProcessor:
    """Feed text deltas with `feed`, end with `finish` (its last event is MessageDone)."""

    def __init__(self, version: str, thinking_mode: str, *, parse_tool_calls: bool = True,
                 new_id: Callable[[], str] = new_tool_call_id) -> None:
        if version not in fmt.VERSIONS or thinking_mode not in fmt.THINKING_MODES:
            raise ValueError(f"unknown version {version!r} or thinking_mode {thinking_mode!r}")
        self._tags = fmt.DSML_TAGS[version]
        self._parse_tool_calls, self._new_id = parse_tool_calls, new_id
        self._eos = _TokenRemover(fmt.EOS)
        self._buf = ""  # text not yet turned into events
        self._phase = "reasoning" if thinking_mode == "thinking" else "content"
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self._events: list[OutputEvent] = []
        self._block_opener = ""  # the open block's opener (and blank line), given back if empty
        self._block_calls = 0
        self._invoke: InvokeScanner | None = None
        self._finished = False

    def feed(self, text: str) -> list[OutputEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += self._eos.feed(text, final=False)
        self._scan(final=False)
        return self._take_events()

    def finish(self) -> list[OutputEvent]:
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._buf += self._eos.feed("", final=True)
        self._scan(final=True)
        self._finished = True
        self._events.append(MessageDone(self.message(), bool(self._calls)))
        return self._take_events()

    def message(self) -> dict[str, Any]:
        """The message so far (final once finished), DeepSeek's fields plus call ids."""
        calls = [{**c, "function": dict(c["function"])} for c in self._calls]
        return {"role": "assistant", "content": "".join(self._content),
                "reasoning_content": "".join(self._reasoning), "tool_calls": calls}

    @property
    def tools_called(self) -> bool:
        return bool(self._calls)

    def _take_events(self) -> list[OutputEvent]:
        events, self._events = self._events, []
        return events

    def _emit_text(self, kind: type, text: str) -> None:
        if not text:
            return
        (self._reasoning if kind is ReasoningDelta else self._content).append(text)
        if self._events and type(self._events[-1]) is kind:
            text = self._events.pop().text + text  # one delta per kind per feed() call
        self._events.append(kind(text))

    def _scan(self, final: bool) -> None:
        step = {"reasoning": self._scan_reasoning, "content": self._scan_content,
                "block": self._scan_block}
        while step[self._phase](final):
            pass

    def _emit_up_to_held(self, kind: type, final: bool, *tokens: str) -> None:
        hold = 0 if final else max(_held_length(self._buf, t) for t in tokens)
        self._emit_text(kind, self._buf[: len(self._buf) - hold])
        self._buf = self._buf[len(self._buf) - hold:]

    def _scan_reasoning(self, final: bool) -> bool:
        at = self._buf.find(fmt.THINK_END)
        if at == -1:
            self._emit_up_to_held(ReasoningDelta, final, fmt.THINK_END)
            return False
        self._emit_text(ReasoningDelta, self._buf[:at])
        self._buf = self._buf[at + len(fmt.THINK_END):]
        self._phase = "content"
        return True

    def _scan_content(self, final: bool) -> bool:
        if not self._parse_tool_calls:
            self._emit_up_to_held(ContentDelta, True)
            return False
        opener = self._tags.block_open
        at = self._buf.find(opener)
        if at == -1:
            self._emit_up_to_held(ContentDelta, final, opener, "\n\n" + opener)
            return False
        blank = "\n\n" if self._buf[:at].endswith("\n\n") else ""
        self._emit_text(ContentDelta, self._buf[: at - len(blank)])
        self._buf = self._buf[at + len(opener):]
        self._phase, self._block_opener, self._block_calls = "block", blank + opener, 0
        return True

    def _scan_block(self, final: bool) -> bool:
        tags = self._tags
        if self._invoke is None:  # between elements
            stripped = self._buf.lstrip()
            if stripped.startswith(tags.block_close):
                self._buf = stripped[len(tags.block_close):]
                self._phase = "content"
                return True
            if stripped.startswith(tags.invoke_open):
                self._invoke = InvokeScanner.at(tags, len(self._buf) - len(stripped))
                return True
            if not final and (tags.block_close.startswith(stripped)
                              or tags.invoke_open.startswith(stripped)):
                return False
            self._abandon_block()
            return True
        status = self._invoke.advance(self._buf, final)
        if status == INCOMPLETE:
            return False
        if status == COMPLETE:
            self._commit_call(self._invoke)
            self._buf = self._buf[self._invoke.end:]
            self._invoke = None
        else:
            self._abandon_block()
        return True

    def _abandon_block(self) -> None:
        """Malformed or truncated markup: read the rest as content from where it went wrong."""
        if self._block_calls == 0:
            self._emit_text(ContentDelta, self._block_opener)
        self._invoke = None
        self._phase = "content"

    def _commit_call(self, invoke: InvokeScanner) -> None:
        index, call_id = len(self._calls), self._new_id()
        arguments = parameters_to_arguments(invoke.params, repair=True)
        self._calls.append({"id": call_id, "type": "function",
                            "function": {"name": invoke.name, "arguments": arguments}})
        self._block_calls += 1
        self._events.append(ToolCallStart(index, call_id, invoke.name))
        self._events.append(ToolCallArgumentsDelta(index, arguments))


def parse_completion_lenient(text: str, version: str, thinking_mode: str, *,
                             parse_tool_calls: bool = True,
                             new_id: Callable[[], str] = new_tool_call_id) -> dict[str, Any]:
    """The final message of the streaming processor for the whole text; never raises on text."""
    processor = DeepSeekOutputProcessor(version, thinking_mode, parse_tool_calls=parse_tool_calls,
                                        new_id=new_id)
    processor.feed(text)
    processor.finish()
    return processor.message()
