"""An Anthropic Messages request (`POST /v1/messages`, `/v1/messages/count_tokens`) as an OpenAI
chat-completions body, the way vLLM's Anthropic endpoint translates it.

- `system` (a string or text blocks) → the first message, role system. A text block that is
  Claude Code's per-request `x-anthropic-billing-header` is left out (it changes every request
  and would defeat the prefix cache; vLLM drops it too).
- Messages (role user / assistant; content a string or blocks):
  `text` → text parts; `tool_use` (assistant) → a tool call, its `input` object as the JSON
  arguments string; `tool_result` (user) → a `tool` message answering its `tool_use_id` (content a
  string or text blocks; `is_error: true` prefixes the text with "Error: ", since DeepSeek's tool
  results carry no error flag); `thinking` → the assistant turn's `reasoning_content`;
  `redacted_thinking` is dropped (opaque); `image` (user messages and tool results; source
  `base64` → a `data:` URL, `url` → the URL) → an `image_url` part (DeepSeek-V4.1 with its
  vision tower; server/multimodal.py loads it); `document` is refused.
- `tools` (custom tools: `name`, `description`, `input_schema`) → function tools; server tools
  (`web_search_…`, `bash_…`, …) are refused. `tool_choice` auto / any (→ required) / none / tool
  (→ the named function); `disable_parallel_tool_use` → `parallel_tool_calls: false`.
- `thinking` enabled / adaptive → thinking on, disabled → off, absent → the model's default
  (DeepSeek: on, as vLLM's DeepSeek modes). `budget_tokens` is checked but not enforced: the
  reasoning and the answer share `max_tokens`, as they do on Anthropic's API.
  `output_config.effort` → the model's reasoning effort (server/adapters/common.py), and
  `output_config.format` (json_schema) → the chat path's response format.
- `max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream` map one to one;
  `metadata.user_id` is the session (DP / prefix-cache affinity) key.
Other fields (`cache_control`, `service_tier`, `container`, …) are ignored, as Anthropic clients expect.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import ProtocolError
from .common import Translation, reasoning_fields

BILLING_HEADER = "x-anthropic-billing-header"
_SAMPLING = ("temperature", "top_p", "top_k", "stream")
_UNSUPPORTED_BLOCKS = {"document": "document input is not supported by this server"}
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # what Anthropic's API takes
# The chat path's names for what an Anthropic client calls otherwise, in error messages.
_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "user": "metadata",
           "response_format": "output_config", "chat_template_kwargs": "thinking",
           "reasoning_effort": "output_config"}
_RENAMES = (("'max_completion_tokens'", "'max_tokens'"), ("'stop'", "'stop_sequences'"),
            ("'user'", "'metadata.user_id'"), ("'response_format'", "'output_config.format'"),
            (".function.parameters", ".input_schema"), (".function.name", ".name"))


def _fail(message: str, param: str | None = None) -> ProtocolError:
    return ProtocolError(message, param, "invalid_value")


def translate(body: Any, version: str | None, *, count_only: bool = False) -> Translation:
    """The chat body for an Anthropic request (`count_only`: count_tokens, no sampling fields)."""
    if not isinstance(body, dict):
        raise _fail("the request body must be a JSON object")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _fail("'messages' must be a non-empty array", "messages")
    messages, sources = _system(body.get("system"))
    for i, message in enumerate(raw):
        _message(message, f"messages[{i}]", messages, sources)
    chat: dict = {"model": body.get("model"), "messages": messages}
    tools = _tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    chat.update(_tool_choice(body.get("tool_choice")))
    chat.update(_reasoning(body, version))
    if not count_only:
        if "max_tokens" not in body:
            raise _fail("'max_tokens' is required", "max_tokens")
        chat["max_tokens"] = body["max_tokens"]
        chat.update({k: body[k] for k in _SAMPLING if k in body})
        stops = body.get("stop_sequences")
        if stops is not None:
            chat["stop"] = stops  # the chat path checks the strings
        chat.update(_metadata(body.get("metadata")))
        chat.update(_output_format(body.get("output_config")))
    return Translation(chat, _PARAMS, _RENAMES, sources)


def _system(system: Any) -> tuple[list[dict], list[str]]:
    if system is None:
        return [], []
    if isinstance(system, str):
        return [{"role": "system", "content": system}], ["system"]
    if not isinstance(system, list):
        raise _fail("'system' must be a string or an array of text blocks", "system")
    parts = []
    for k, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise _fail(f"system[{k}] must be a text block {{\"type\": \"text\", \"text\": ...}}", "system")
        if not block["text"].startswith(BILLING_HEADER):
            parts.append({"type": "text", "text": block["text"]})
    return ([{"role": "system", "content": parts}], ["system"]) if parts else ([], [])


def _message(message: Any, where: str, out: list[dict], sources: list[str]) -> None:
    """Append the chat messages one Anthropic message becomes (a user message with tool
    results becomes tool messages, then a user message for its other text)."""
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("user", "assistant"):
        raise _fail(f"{where}.role must be 'user' or 'assistant'", "messages")
    content = message.get("content")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        sources.append(where)
        return
    if not isinstance(content, list):
        raise _fail(f"{where}.content must be a string or an array of content blocks", "messages")
    if role == "assistant":
        out.append(_assistant(content, where))
        sources.append(where)
        return
    parts: list[dict] = []
    for k, block in enumerate(content):
        spot = f"{where}.content[{k}]"
        kind = _block_type(block, spot)
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, spot)})
        elif kind == "image":
            parts.append(_image(block, spot))
        elif kind == "tool_result":
            if parts:  # text before a tool result: keep the order
                out.append({"role": "user", "content": parts})
                sources.append(where)
                parts = []
            out.append(_tool_result(block, spot))
            sources.append(spot)
        else:
            raise _fail(f"{spot}: a {kind!r} block cannot be in a user message", "messages")
    if parts or not content:
        out.append({"role": "user", "content": parts})
        sources.append(where)


def _assistant(content: list, where: str) -> dict:
    parts: list[dict] = []
    calls: list[dict] = []
    reasoning: list[str] = []
    for k, block in enumerate(content):
        spot = f"{where}.content[{k}]"
        kind = _block_type(block, spot)
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, spot)})
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise _fail(f"{spot}.thinking must be a string", "messages")
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # opaque: nothing to render
        elif kind == "tool_use":
            calls.append(_tool_use(block, spot))
        else:
            raise _fail(f"{spot}: a {kind!r} block cannot be in an assistant message", "messages")
    message: dict = {"role": "assistant", "content": parts}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _block_type(block: Any, spot: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise _fail(f"{spot} must be a content block with a 'type'", "messages")
    if kind in _UNSUPPORTED_BLOCKS:
        raise ProtocolError(f"{spot}: {_UNSUPPORTED_BLOCKS[kind]}", "messages", "unsupported")
    if kind not in ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"):
        raise ProtocolError(f"{spot}: content blocks of type {kind!r} are not supported", "messages", "unsupported")
    return kind


def _text(block: dict, spot: str) -> str:
    if not isinstance(block.get("text"), str):
        raise _fail(f"{spot}.text must be a string", "messages")
    return block["text"]


def _tool_use(block: dict, spot: str) -> dict:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
        raise _fail(f"{spot}: a tool_use block needs a string 'id' and 'name'", "messages")
    if not isinstance(arguments, dict):
        raise _fail(f"{spot}.input must be an object", "messages")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _tool_result(block: dict, spot: str) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _fail(f"{spot}.tool_use_id must be a non-empty string", "messages")
    content = block.get("content", "")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise _fail(f"{spot}.is_error must be a boolean", "messages")
    prefix = "Error: " if is_error else ""
    if isinstance(content, list):
        parts: list[dict] = []  # text blocks in a row joined by newlines, images between them
        for j, inner in enumerate(content):
            inner_spot = f"{spot}.content[{j}]"
            kind = _block_type(inner, inner_spot)
            if kind == "image":
                parts.append(_image(inner, inner_spot))
            elif kind == "text":
                if parts and parts[-1]["type"] == "text":
                    parts[-1]["text"] += "\n" + _text(inner, inner_spot)
                else:
                    parts.append({"type": "text", "text": _text(inner, inner_spot)})
            else:
                raise ProtocolError(f"{inner_spot}: a tool result holds text and image blocks only", "messages",
                                    "unsupported")
        if all(p["type"] == "text" for p in parts):
            content = "\n".join(p["text"] for p in parts)
        else:
            if prefix:
                parts.insert(0, {"type": "text", "text": prefix.rstrip()})
            return {"role": "tool", "tool_call_id": call_id, "content": parts}
    elif not isinstance(content, str):
        raise _fail(f"{spot}.content must be a string or an array of text and image blocks", "messages")
    return {"role": "tool", "tool_call_id": call_id, "content": prefix + content}


def _image(block: dict, spot: str) -> dict:
    """An image block as a chat `image_url` part (loaded later, by the chat path)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in IMAGE_MEDIA_TYPES:
            raise _fail(f"{spot}.source.media_type must be one of {', '.join(IMAGE_MEDIA_TYPES)}, got {media_type!r}",
                        "messages")
        if not isinstance(data, str) or not data:
            raise _fail(f"{spot}.source.data must be a non-empty base64 string", "messages")
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise _fail(f"{spot}.source.url must be a non-empty string", "messages")
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "file":
        raise ProtocolError(f"{spot}: images by file_id need the Files API, which this server does not have; send "
                            "the image as base64 or a URL", "messages", "unsupported")
    raise _fail(f"{spot}.source must be {{\"type\": \"base64\", \"media_type\", \"data\"}} or "
                f"{{\"type\": \"url\", \"url\"}}", "messages")


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _fail("'tools' must be an array of tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _fail(f"tools[{i}] must be an object", "tools")
        kind = tool.get("type", "custom")
        if kind not in ("custom", None):
            raise ProtocolError(f"tools[{i}] is a server tool ({kind!r}), which this server does not run; define it "
                                "as a custom tool with an input_schema", "tools", "unsupported")
        if "input_schema" not in tool:
            raise _fail(f"tools[{i}].input_schema is required", "tools")
        function = {"name": tool.get("name")}  # OpenAI's key order: the encoder writes the tool as given
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": function})  # checked by the chat path (parse_tools)
    return out


def _tool_choice(choice: Any) -> dict:
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _fail("tool_choice of type 'tool' needs the tool's 'name'", "tool_choice")
        mapped = {"type": "function", "function": {"name": choice["name"]}}
    if mapped is None:
        raise _fail("tool_choice.type must be auto, any, tool or none", "tool_choice")
    out: dict = {"tool_choice": mapped}
    disable = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise _fail("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
    if disable:
        out["parallel_tool_calls"] = False
    return out


def _reasoning(body: dict, version: str | None) -> dict:
    thinking = body.get("thinking")
    on = None
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise _fail("thinking.type must be enabled, disabled or adaptive", "thinking")
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise _fail("thinking.budget_tokens must be a positive integer", "thinking")
        on = kind != "disabled"
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise _fail("'output_config' must be an object", "output_config")
    effort = (config or {}).get("effort")
    return reasoning_fields(version, on, effort, "output_config.effort")


def _metadata(metadata: Any) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise _fail("'metadata' must be an object", "metadata")
    user = metadata.get("user_id")
    return {"user": user} if user is not None else {}  # the chat path checks its type and length


def _output_format(config: Any) -> dict:
    fmt = (config or {}).get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _fail("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_config")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}}
