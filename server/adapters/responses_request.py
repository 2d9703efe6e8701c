"""An OpenAI Responses request (`POST /v1/responses`) as an OpenAI chat-completions body.

Stateless: nothing is stored, so `previous_response_id`, `conversation` and `item_reference`
inputs (which name stored state) are 400s, as are `background` runs and stored `prompt`
templates; `store: true` is served like `store: false` and the response says `"store": false`.

- `instructions` → a leading system message; `input` as text → one user message; as items:
  messages (role user / system / developer / assistant; content a string or `input_text` /
  `output_text` / `refusal` parts, `input_image` by `image_url` → a chat image part (DeepSeek-V4.1;
  by `file_id` refused: nothing is stored); files and audio refused), `function_call` → a tool call
  of the assistant turn (joined to the assistant message just before it), `function_call_output`
  → a `tool` message answering its `call_id`, `reasoning` (its `reasoning_text` content, else its
  summary) → the `reasoning_content` of the assistant turn it belongs to (the next one, or the one
  it interrupts).
- Function `tools` (Responses' flat shape: `name`, `description`, `parameters`) → chat tools;
  hosted tools (web search, file search, …) refused. `tool_choice` auto / none / required /
  `{"type": "function", "name"}`; `parallel_tool_calls`.
- `reasoning.effort` → thinking and reasoning effort (server/adapters/common.py; `none`: no
  reasoning section); `reasoning.summary` is accepted, and the reasoning comes back as text.
- `text.format` (`text` / `json_object` / `json_schema`) → the chat path's `response_format`.
- `max_output_tokens`, `temperature`, `top_p`, `stream`; the session (affinity) key is
  `prompt_cache_key`, else `safety_identifier`, else `user`.
Other fields (`include`, `metadata`, `truncation`, `service_tier`, …) are ignored.
"""

from __future__ import annotations

from typing import Any

from ..errors import ProtocolError
from .common import Translation, reasoning_fields

_STATEFUL = {"previous_response_id": "stored responses", "conversation": "stored conversations",
             "prompt": "stored prompt templates"}
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
_SESSION_FIELDS = ("prompt_cache_key", "safety_identifier", "user")
_RENAMES = (("'max_completion_tokens'", "'max_output_tokens'"), ("'response_format'", "'text.format'"),
            ("response_format.json_schema", "text.format"), ("'messages'", "'input'"), ("'reasoning_effort'",
                                                                                    "'reasoning.effort'"),
            (".function.parameters", ".parameters"), (".function.name", ".name"))


def _fail(message: str, param: str | None = None, code: str = "invalid_value") -> ProtocolError:
    return ProtocolError(message, param, code)


def translate(body: Any, version: str | None) -> Translation:
    if not isinstance(body, dict):
        raise _fail("the request body must be a JSON object")
    for name, what in _STATEFUL.items():
        if body.get(name) is not None:
            raise _fail(f"'{name}' needs {what}, which this server does not keep; send the whole conversation in "
                        "'input'", name, "unsupported")
    if body.get("background"):
        raise _fail("'background' responses are not supported", "background", "unsupported")
    if body.get("top_logprobs"):
        raise _fail("'top_logprobs' is not supported on /v1/responses", "top_logprobs", "unsupported")
    conversation = _Conversation()
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _fail("'instructions' must be a string", "instructions")
        conversation.append({"role": "system", "content": instructions}, "instructions")
    conversation.add_input(body.get("input"))
    chat: dict = {"model": body.get("model"), "messages": conversation.messages}
    chat.update({k: body[k] for k in ("temperature", "top_p", "stream", "parallel_tool_calls") if k in body})
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    tools = _tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    chat.update(_reasoning(body.get("reasoning"), version))
    chat.update(_text_format(body.get("text")))
    session = next((k for k in _SESSION_FIELDS if body.get(k) is not None), None)
    params = {"max_completion_tokens": "max_output_tokens", "response_format": "text", "structured_outputs": "text",
              "messages": "input", "reasoning_effort": "reasoning"}
    renames = _RENAMES
    if session is not None:
        chat["user"] = body[session]
        params["user"] = session
        renames += (("'user'", f"'{session}'"),)
    return Translation(chat, params, renames, conversation.sources)


class _Conversation:
    """Chat messages built item by item (function calls join the assistant turn before them)."""

    def __init__(self):
        self.messages: list[dict] = []
        self.sources: list[str] = []
        self._reasoning: list[str] = []  # reasoning items waiting for their assistant turn

    def append(self, message: dict, where: str) -> None:
        self.messages.append(message)
        self.sources.append(where)

    def add_input(self, items: Any) -> None:
        if isinstance(items, str):
            self.append({"role": "user", "content": items}, "input")
            return
        if not isinstance(items, list) or not items:
            raise _fail("'input' must be a string or a non-empty array of input items", "input")
        for i, item in enumerate(items):
            self._item(item, f"input[{i}]")
        if self._reasoning:  # reasoning after the last turn: an assistant turn of its own
            self._assistant_turn("input")

    def _item(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise _fail(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            self._message(item, where)
        elif kind == "function_call":
            self._function_call(item, where)
        elif kind == "function_call_output":
            self._function_output(item, where)
        elif kind == "reasoning":
            self._reasoning.append(_reasoning_text(item, where))
        elif kind == "item_reference":
            raise _fail(f"{where}: 'item_reference' needs stored items, which this server does not keep", "input",
                        "unsupported")
        else:
            raise _fail(f"{where}: input items of type {kind!r} are not supported", "input", "unsupported")

    def _message(self, item: dict, where: str) -> None:
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise _fail(f"{where}.role must be user, system, developer or assistant", "input")
        content = _content(item.get("content"), where)
        if role == "assistant":
            self._assistant_turn(where)["content"] = content
        else:
            self.append({"role": role, "content": content}, where)

    def _function_call(self, item: dict, where: str) -> None:
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
        if not all(isinstance(v, str) for v in (call_id, name, arguments)) or not call_id or not name:
            raise _fail(f"{where}: a function_call needs string 'call_id', 'name' and 'arguments'", "input")
        last = self.messages[-1] if self.messages else None
        turn = last if last is not None and last["role"] == "assistant" else self._assistant_turn(where)
        if turn is last and self._reasoning:
            turn["reasoning_content"] = (turn.get("reasoning_content") or "") + "".join(self._reasoning)
            self._reasoning = []
        turn.setdefault("tool_calls", []).append({"id": call_id, "type": "function",
                                                  "function": {"name": name, "arguments": arguments}})

    def _function_output(self, item: dict, where: str) -> None:
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not call_id:
            raise _fail(f"{where}.call_id must be a non-empty string", "input")
        if isinstance(output, list):
            parts = _content(output, where)
            output = "\n".join(p["text"] for p in parts) if all(p["type"] == "text" for p in parts) else parts
        if not isinstance(output, (str, list)):
            raise _fail(f"{where}.output must be a string or an array of input_text parts", "input")
        self.append({"role": "tool", "tool_call_id": call_id, "content": output}, where)

    def _assistant_turn(self, where: str) -> dict:
        turn: dict = {"role": "assistant", "content": ""}
        if self._reasoning:
            turn["reasoning_content"] = "".join(self._reasoning)
            self._reasoning = []
        self.append(turn, where)
        return turn


def _content(content: Any, where: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail(f"{where}.content must be a string or an array of content parts", "input")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            parts.append(_input_image(part, f"{where}.content[{k}]"))
            continue
        if kind not in _TEXT_PARTS:
            what = "file and audio input are" if kind in ("input_file", "input_audio") else \
                f"content parts of type {kind!r} are"
            raise _fail(f"{where}.content[{k}]: {what} not supported by this server", "input", "unsupported")
        text = part.get(_TEXT_PARTS[kind])
        if not isinstance(text, str):
            raise _fail(f"{where}.content[{k}].{_TEXT_PARTS[kind]} must be a string", "input")
        parts.append({"type": "text", "text": text})
    return parts


def _input_image(part: dict, where: str) -> dict:
    url = part.get("image_url")
    if url is None and part.get("file_id") is not None:
        raise _fail(f"{where}: an input_image by file_id needs stored files, which this stateless server has not; "
                    "send image_url (a data: or http(s) URL)", "input", "unsupported")
    if not isinstance(url, str) or not url:
        raise _fail(f"{where}.image_url must be a non-empty string (a data: or http(s) URL)", "input")
    return {"type": "image_url", "image_url": {"url": url}}


def _reasoning_text(item: dict, where: str) -> str:
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                  for p in parts):
            raise _fail(f"{where}.{key} must be an array of {kind} parts", "input")
        if parts:
            return "".join(p["text"] for p in parts)
    return ""


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _fail("'tools' must be an array of tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _fail(f"tools[{i}] is of type {kind!r}; this server runs function tools only", "tools",
                        "unsupported")
        function = {"name": tool.get("name")}
        for key in ("description", "parameters"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})  # checked by the chat path (parse_tools)
    return out


def _tool_choice(choice: Any) -> str | dict:
    if isinstance(choice, str):
        return choice  # auto / none / required, checked by the chat path
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise _fail(f"tool_choice must be auto, none, required or {{\"type\": \"function\", \"name\": ...}}; got {kind!r}",
                "tool_choice", "unsupported" if kind else "invalid_value")


def _reasoning(reasoning: Any, version: str | None) -> dict:
    if reasoning is None:
        return {}
    if not isinstance(reasoning, dict):
        raise _fail("'reasoning' must be an object", "reasoning")
    effort = reasoning.get("effort")
    if effort == "none":
        return reasoning_fields(version, False, None, "reasoning.effort")
    return reasoning_fields(version, None, effort, "reasoning.effort")


def _text_format(text: Any) -> dict:
    if text is None:
        return {}
    if not isinstance(text, dict):
        raise _fail("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"response_format": {"type": "json_schema", "json_schema": inner}}
    raise _fail("text.format.type must be text, json_object or json_schema", "text")
