"""OpenAI-style chat messages checked and turned into DeepSeek-V4 / V4.1 turns.

What DeepSeek's encoders (`encoding_dsv4.py`, V4.1 `encoding.py`) accept, made explicit: every
input they would crash on or that is invalid for the API raises `EncodingError` naming the
message index and the problem. The rules kept from the official encoders:

- Roles: `system`, `user`, `assistant`, `tool`, `latest_reminder`, and `developer` for V4 only.
  Any other role (V4.1's encoder has no developer role) is refused where it would be rendered;
  like DeepSeek's encoders, thinking mode drops it silently when it comes before the last user
  turn and reasoning is not kept. A caller that wants OpenAI's meaning of `developer` on V4.1
  sends it as `system`.
- A `tool` message becomes a `<tool_result>...</tool_result>` part of a user turn: it joins the
  preceding user turn, and a user message that follows tool results (or another user message
  without a `task`) joins that turn too. Parts are joined with a blank line when rendered.
- Tool results in one turn are re-ordered (stable sort) to the order of the latest assistant
  `tool_calls` ids; results whose id is unknown sort as the first call.
- Content may be a string or a list of OpenAI content parts: `text` parts, and for V4.1 image
  parts (`image_url`, `image`, `input_image`) rendered as `<｜deepseek_image｜>`. V4 has no image
  input. Parts are joined with a blank line (V4.1's rule; V4's encoder takes strings only).
- V4.1 refuses `<｜deepseek_image｜>` typed into text (official). No other special token or DSML
  markup in user text is escaped or refused by either encoder: it is kept verbatim.
- Assistant reasoning is `reasoning_content`, or vLLM's `reasoning` alias when that is absent.
- `tools` on a message count for the "keep reasoning when tools are present" rule but are rendered
  only on system/developer messages; V4 forgets `tools` set on a user message (its merge step keeps
  only `task`/`wo_eos`), V4.1 keeps them. Request-level tools go on a leading system (V4: or
  developer) message, else on a new empty system message in front (vLLM's placement).

Checks added here (the official encoders would render nonsense or crash): a `tool` message must
follow an assistant message with `tool_calls`, and a `tool_call_id` it gives must be one of those
calls' ids when the calls carry ids; content of the wrong type is refused instead of printed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from server.chat.deepseek_format import IMAGE_PLACEHOLDER, TASK_TOKENS


class EncodingError(ValueError):
    """A conversation the DeepSeek encoding cannot render; the message names the problem."""


@dataclass
class ToolCallIn:
    call_id: str  # "" when the call carries no id
    name: str
    arguments: Any  # as sent: normally a JSON string (see dsml.arguments_to_parameters)


@dataclass
class UserPart:
    text: str  # already rendered: plain text, an image placeholder or a <tool_result> block
    tool_call_id: str | None = None  # set on tool results only (their sort key)


@dataclass
class Turn:
    role: str  # system | developer | user | assistant | latest_reminder, or an unknown role
    source: int = -1  # index of the (first) message it comes from, for error messages
    text: str = ""
    parts: list[UserPart] = field(default_factory=list)  # user turns
    reasoning: str | None = None  # assistant turns; None when absent
    tool_calls: list[ToolCallIn] = field(default_factory=list)
    tools: list[dict] | None = None  # the OpenAI tool objects, as sent
    response_format: Any = None
    task: str | None = None
    wo_eos: bool = False


def _fail(index: int, problem: str) -> EncodingError:
    return EncodingError(f"messages[{index}]: {problem}")


def check_tools(tools: Any, where: str) -> list[dict]:
    if not isinstance(tools, list):
        raise EncodingError(f"{where}: tools must be a list of tool objects")
    for k, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise EncodingError(
                f'{where}: tools[{k}] must be {{"type": "function", "function": {{"name": ...}}}}'
            )
    return tools


def _image_has_source(part: dict) -> bool:
    kind = part["type"]
    if kind == "image_url":
        url = part.get("image_url")
        return bool(url if isinstance(url, str) else (url or {}).get("url"))
    if kind == "input_image":
        return bool(part.get("image_url") or part.get("file_id"))
    return any(part.get(key) for key in ("source", "url", "data", "image"))


def _check_text(text: str, index: int, version: str, what: str) -> str:
    if version == "v41" and IMAGE_PLACEHOLDER in text:
        raise _fail(index, f"{what} contains the image token {IMAGE_PLACEHOLDER}; send images as "
                           "image content parts")
    return text


def _content_parts(content: Any, index: int, version: str) -> list[str]:
    """A message's content as rendered pieces; a string is one piece."""
    if isinstance(content, str):
        return [_check_text(content, index, version, "content")]
    if not isinstance(content, list):
        raise _fail(index, f"content must be a string or a list of content parts, not "
                           f"{type(content).__name__}")
    pieces = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text", "")
            if not isinstance(text, str):
                raise _fail(index, f"content[{k}].text must be a string")
            pieces.append(_check_text(text, index, version, f"content[{k}].text"))
        elif kind in ("image_url", "image", "input_image"):
            if version == "v4":
                raise _fail(index, f"content[{k}] is an image; DeepSeek-V4 takes text only")
            if not _image_has_source(part):
                raise _fail(index, f"content[{k}] is an image part without a source")
            pieces.append(IMAGE_PLACEHOLDER)
        else:
            raise _fail(index, f"content[{k}] has unsupported type {kind!r} "
                               "(text and, for V4.1, image parts are supported)")
    return pieces


def _joined_content(msg: dict, index: int, version: str, *, none_ok: bool) -> str:
    content = msg.get("content")
    if content is None:
        if none_ok or "content" not in msg:
            return ""
        raise _fail(index, f"{msg['role']} message content must not be null")
    return "\n\n".join(_content_parts(content, index, version))


def _tool_calls(msg: dict, index: int) -> list[ToolCallIn]:
    raw = msg.get("tool_calls")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _fail(index, "tool_calls must be a list")
    calls = []
    for k, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _fail(index, f'tool_calls[{k}] must be {{"function": {{"name": ..., '
                               '"arguments": ...}}')
        if "arguments" not in function:
            raise _fail(index, f"tool_calls[{k}].function has no arguments")
        call_id = call.get("id") or function.get("id") or ""
        if not isinstance(call_id, str):
            raise _fail(index, f"tool_calls[{k}].id must be a string")
        calls.append(ToolCallIn(call_id, function["name"], function["arguments"]))
    return calls


def _reasoning(msg: dict, index: int, version: str) -> str | None:
    reasoning = msg.get("reasoning_content")
    if reasoning is None:
        reasoning = msg.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, str):
        raise _fail(index, "reasoning_content must be a string")
    if reasoning is not None:
        _check_text(reasoning, index, version, "reasoning_content")
    return reasoning


def _turn(msg: Any, index: int, version: str) -> Turn:
    if not isinstance(msg, dict):
        raise _fail(index, "each message must be an object")
    role = msg.get("role")
    task = msg.get("task")
    if task is not None and (not isinstance(task, str) or task not in TASK_TOKENS):
        raise _fail(index, f"unknown task {task!r}; known tasks: {sorted(TASK_TOKENS)}")
    tools = msg.get("tools")
    if tools is not None:
        check_tools(tools, f"messages[{index}]")
    common = dict(role=role, source=index, tools=tools, task=task,
                  response_format=msg.get("response_format"))
    if role == "system":
        return Turn(text=_joined_content(msg, index, version, none_ok=True), **common)
    if role == "developer" and version == "v4":
        return Turn(text=_joined_content(msg, index, version, none_ok=True), **common)
    if role == "user":
        content = msg.get("content", "")
        if content is None:
            raise _fail(index, "user message content must not be null")
        parts = [UserPart(p) for p in _content_parts(content, index, version)]
        return Turn(parts=parts, wo_eos=bool(msg.get("wo_eos")), **common)
    if role == "assistant":
        return Turn(text=_joined_content(msg, index, version, none_ok=True),
                    reasoning=_reasoning(msg, index, version), tool_calls=_tool_calls(msg, index),
                    wo_eos=bool(msg.get("wo_eos")), **common)
    if role == "latest_reminder":
        if not isinstance(msg.get("content"), (str, list)):
            raise _fail(index, "latest_reminder content must be a string")
        return Turn(text=_joined_content(msg, index, version, none_ok=False), **common)
    if role == "tool":
        call_id = msg.get("tool_call_id") or ""
        if not isinstance(call_id, str):
            raise _fail(index, "tool_call_id must be a string")
        result = _joined_content(msg, index, version, none_ok=False)
        return Turn(parts=[UserPart(f"<tool_result>{result}</tool_result>", call_id)], **common)
    if version == "v41" and isinstance(msg.get("content"), (str, list)):
        _content_parts(msg["content"], index, version)  # V4.1 checks every message's content
    return Turn(**common)  # an unknown role: refused by the renderer if it renders it


def _check_tool_answers(turns: list[Turn]) -> None:
    """Each tool message answers a call of the latest assistant message (by id when ids exist)."""
    call_ids: list[str] | None = None  # ids of the latest assistant's calls; None: no calls
    for index, turn in enumerate(turns):
        if turn.role == "assistant":
            call_ids = [c.call_id for c in turn.tool_calls] if turn.tool_calls else None
        elif turn.role == "tool":
            if call_ids is None:
                raise _fail(index, "tool message does not follow an assistant message with "
                                   "tool_calls")
            answer_id = turn.parts[0].tool_call_id
            if answer_id and any(call_ids) and answer_id not in call_ids:
                raise _fail(index, f"tool_call_id {answer_id!r} matches no call of the "
                                   f"preceding assistant message (ids: {call_ids})")


def _merge(turns: list[Turn], version: str) -> list[Turn]:
    """Tool results and follow-up user text join the user turn before them (official merge)."""
    merged: list[Turn] = []
    for turn in turns:
        previous = merged[-1] if merged and merged[-1].role == "user" else None
        if turn.role == "tool":
            if previous is not None:
                previous.parts.extend(turn.parts)
            else:
                merged.append(Turn(role="user", source=turn.source, parts=list(turn.parts)))
        elif turn.role == "user":
            if previous is not None and previous.task is None:
                previous.parts.extend(turn.parts)
            else:
                if version == "v4":
                    # V4's merge keeps only task/wo_eos of a user message: its tools are lost.
                    turn.tools, turn.response_format = None, None
                merged.append(turn)
        else:
            merged.append(turn)
    return merged


def _sort_tool_results(turns: list[Turn]) -> None:
    """Stable-sort each turn's tool results into the latest assistant's call order."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            order = {c.call_id: k for k, c in enumerate(turn.tool_calls) if c.call_id}
        elif turn.role == "user" and order:
            slots = [k for k, p in enumerate(turn.parts) if p.tool_call_id is not None]
            if len(slots) > 1:
                ordered = sorted((turn.parts[k] for k in slots),
                                 key=lambda p: order.get(p.tool_call_id or "", 0))
                for k, part in zip(slots, ordered):
                    turn.parts[k] = part


def _attach_request_tools(turns: list[Turn], tools: list[dict], version: str) -> list[Turn]:
    """Request-level tools go on a leading system (V4: or developer) message, else on a new empty
    system message in front, as vLLM's DeepSeek tokenizers place them."""
    check_tools(tools, "tools")
    head_roles = ("system", "developer") if version == "v4" else ("system",)
    if turns[0].role in head_roles:
        if turns[0].tools:
            raise EncodingError("tools are given both in the request and on messages[0]")
        turns[0].tools = tools
        return turns
    return [Turn(role="system", tools=tools), *turns]


def conversation_turns(messages: Any, version: str, request_tools: list[dict] | None = None
                       ) -> list[Turn]:
    """Check `messages` and return the merged, re-ordered turns the renderer walks."""
    if not isinstance(messages, list) or not messages:
        raise EncodingError("messages must be a non-empty list")
    turns = [_turn(msg, index, version) for index, msg in enumerate(messages)]
    _check_tool_answers(turns)
    if request_tools:
        turns = _attach_request_tools(turns, request_tools, version)
    merged = _merge(turns, version)
    _sort_tool_results(merged)
    return merged
