"""The strict parser of a DeepSeek-V4 / V4.1 completion: accepts and refuses exactly what the
releases' `parse_message_from_completion_text` does, and builds the same message.

The completion is the model's text after the generation prompt (`<｜Assistant｜><think>` in
thinking mode, `<｜Assistant｜></think>` in chat mode), special tokens kept as text. The official
reading, step by step:
1. thinking mode: the reasoning runs to the first `</think>`; a tool block (or the end) first is
   an error.
2. the content runs to the EOS token or to `\\n\\n<｜DSML｜tool_calls`; without either, an error.
3. a tool block is read element by element with the exact separators of `dsml`'s grammar; the
   block may end the text (no EOS needed); anything between it and the EOS is an error.
4. nothing may follow the EOS, and neither content nor reasoning may contain BOS, EOS,
   `<think>`, `</think>` or `｜DSML｜`.
Like the official reader, it accepts a block cut exactly at an element boundary (for example
right after `<｜DSML｜invoke name="x">\\n`). The serving parser (`output_parser`) does not: it
returns such a truncated block as content.
"""

from __future__ import annotations

from typing import Any

from server.chat import deepseek_format as fmt
from server.chat.dsml import HEADER_STRICT, PARAM_STRICT, _earliest, parameters_to_arguments


class CompletionParseError(ValueError):
    """A completion DeepSeek's own parser refuses; the message says where it breaks."""


class _Reader:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def until(self, *stops: str) -> tuple[str, str | None]:
        """Text up to the first of `stops` (consumed too), or to the end and None."""
        at, stop = _earliest(self.text, self.pos, stops)
        if stop is None:
            segment, self.pos = self.text[self.pos:], len(self.text)
        else:
            segment, self.pos = self.text[self.pos:at], at + len(stop)
        return segment, stop


def _tool_calls(reader: _Reader, tags: fmt.DsmlTags) -> list[dict[str, Any]]:
    calls = []
    invoke_end = tags.invoke_close[:-1]  # the official stop tags exclude the closing ">"
    param_end = f"/{fmt.DSML}{tags.parameter}"
    while reader.pos < len(reader.text):
        gap, stop = reader.until(tags.invoke_open, tags.block_close)
        if gap != ">\n":
            raise CompletionParseError(f"tool call format error: expected '>\\n', got {gap!r}")
        if stop == tags.block_close:
            break
        if stop is None:
            raise CompletionParseError("tool call block ends without its closing tag")
        header, stop = reader.until(tags.parameter_open, invoke_end)
        match = HEADER_STRICT.match(header)
        if match is None:
            raise CompletionParseError(f"tool name format error: {header!r}")
        params: list[tuple[str, str, bool]] = []
        while stop == tags.parameter_open:
            body, _ = reader.until(param_end)
            param = PARAM_STRICT.match(body)
            if param is None:
                raise CompletionParseError(f"parameter format error: {body!r}")
            if any(param.group(1) == p[0] for p in params):
                raise CompletionParseError(f"duplicate parameter name {param.group(1)!r}")
            params.append((param.group(1), param.group(3), param.group(2) == "true"))
            gap, stop = reader.until(tags.parameter_open, invoke_end)
            if gap != ">\n":
                raise CompletionParseError(f"parameter format error: expected '>\\n', got {gap!r}")
        calls.append({"type": "function", "function": {
            "name": match.group(1), "arguments": parameters_to_arguments(params, repair=False)}})
    return calls


def parse_completion(text: str, version: str, thinking_mode: str) -> dict[str, Any]:
    """`{"role", "content", "reasoning_content", "tool_calls"}` as DeepSeek's parser returns it.

    Raises CompletionParseError where DeepSeek's parser raises.
    """
    if version not in fmt.VERSIONS or thinking_mode not in fmt.THINKING_MODES:
        raise ValueError(f"unknown version {version!r} or thinking_mode {thinking_mode!r}")
    tags = fmt.DSML_TAGS[version]
    block_start = "\n\n" + tags.block_open[:-1]  # the official start tag excludes the ">"
    reader = _Reader(text)
    reasoning = ""
    if thinking_mode == "thinking":
        reasoning, stop = reader.until(fmt.THINK_END, block_start)
        if stop != fmt.THINK_END:
            raise CompletionParseError("invalid thinking format: missing </think>")
    content, stop = reader.until(fmt.EOS, block_start)
    calls: list[dict[str, Any]] = []
    if stop == block_start:
        calls = _tool_calls(reader, tags)
        trailing, stop = reader.until(fmt.EOS)
        if trailing:
            raise CompletionParseError(f"unexpected text after the tool calls: {trailing!r}")
    elif stop != fmt.EOS:
        raise CompletionParseError("invalid format: missing EOS token")
    if reader.pos != len(text):
        raise CompletionParseError(f"unexpected text after EOS: {text[reader.pos:]!r}")
    for token in (fmt.BOS, fmt.EOS, fmt.THINK_START, fmt.THINK_END, fmt.DSML):
        if token in content or token in reasoning:
            raise CompletionParseError(f"unexpected special token {token!r} in the content")
    return {"role": "assistant", "content": content, "reasoning_content": reasoning,
            "tool_calls": calls}
