"""The chat part of a request, as every chat API reduces to it: messages, tools, tool choice and
the reasoning switches (`ChatRequest`), read from an OpenAI chat-completions body and checked.

What a renderer (server/chat_render.py) needs and nothing else: the Anthropic Messages and
OpenAI Responses adapters build the same `ChatRequest` from their own shapes. Checked here: the
shapes and sizes of tools (each function's `parameters` a valid JSON Schema), the tool choice
against the tools, the chat-template switches vLLM documents for DeepSeek (`thinking` /
`enable_thinking`, `reasoning_effort`, `drop_thinking`; anything else, and a request-supplied
template, is refused). Messages are checked by the renderer, which knows the format's roles.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import ProtocolError

MAX_TOOLS = 128
MAX_TOOLS_CHARS = 256 << 10  # all tool definitions, as JSON
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
TEMPLATE_SWITCHES = ("thinking", "enable_thinking", "reasoning_effort", "drop_thinking")
TOOL_CHOICES = ("auto", "none", "required")
ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")  # latest_reminder: DeepSeek's


@dataclass(frozen=True)
class ChatOptions:
    thinking: bool | None = None  # None: the renderer's default (DeepSeek: on, as vLLM's)
    reasoning_effort: Any = None  # as sent; the renderer checks it for its model ("none": thinking off)
    drop_thinking: bool | None = None  # None: the encoder's rule
    add_generation_prompt: bool = True


@dataclass
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None = None  # OpenAI function tools
    tool_choice: str | dict = "none"  # "auto" | "none" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True
    options: ChatOptions = field(default_factory=ChatOptions)

    @property
    def forced_tool(self) -> str | None:
        """The function a named tool_choice forces, or None."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def parse_chat_request(body: dict) -> ChatRequest:
    """The ChatRequest of an OpenAI chat-completions body (400 naming the field on bad input)."""
    if body.get("chat_template") is not None:
        raise ProtocolError("'chat_template' from the request is refused: the server uses the model's own format",
                            "chat_template", "template_not_allowed")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("'messages' must be a non-empty array", "messages", "invalid_value")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise ProtocolError(f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}"
                                + (f", got {role!r}" if role is not None else ""), "messages", "invalid_value")
        if m["role"] != "assistant" and m.get("content") is None:
            raise ProtocolError(f"messages[{i}] ({m['role']}) is missing 'content'", "messages", "invalid_value")
        if m["role"] == "assistant" and m.get("content") is None and not m.get("tool_calls"):
            raise ProtocolError(f"messages[{i}] (assistant) needs 'content' or 'tool_calls'", "messages",
                                "invalid_value")
    tools = parse_tools(body.get("tools"), "tools")
    choice = parse_tool_choice(body.get("tool_choice"), tools, "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ProtocolError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls", "invalid_type")
    chat = ChatRequest(messages, tools, choice, parallel, _options(body))
    check_forced_tools(chat)
    return chat


def parse_tools(tools: Any, where: str) -> list[dict] | None:
    """OpenAI function tools, checked (names, descriptions, JSON Schema parameters, sizes)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ProtocolError(f"'{where}' must be an array of tools", where, "invalid_type")
    if len(tools) > MAX_TOOLS:
        raise ProtocolError(f"'{where}' holds at most {MAX_TOOLS} tools, got {len(tools)}", where, "too_many")
    if len(json.dumps(tools, ensure_ascii=False)) > MAX_TOOLS_CHARS:
        raise ProtocolError(f"'{where}' is larger than {MAX_TOOLS_CHARS} characters", where, "too_long")
    names = set()
    for i, tool in enumerate(tools):
        spot = f"{where}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ProtocolError(f"'{spot}' must be {{\"type\": \"function\", \"function\": {{...}}}}", where,
                                "invalid_value")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ProtocolError(f"'{spot}.function.name' must be 1-64 letters, digits, '_', '-', '.' or ':'", where,
                                "invalid_value")
        if name in names:
            raise ProtocolError(f"'{where}' names the function {name!r} twice", where, "invalid_value")
        names.add(name)
        if not isinstance(fn.get("description", ""), str):
            raise ProtocolError(f"'{spot}.function.description' must be a string", where, "invalid_type")
        parameters = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ProtocolError(f"'{spot}.function.parameters' must be a JSON Schema object", where, "invalid_value")
        from .structured import check_schema

        check_schema(parameters, f"{spot}.function.parameters", enforced=False, param=where)  # see `check_forced_tools`
    return tools or None


def check_forced_tools(chat: ChatRequest) -> None:
    """A tool choice that forces calls makes a grammar of the tools' parameter schemas: they may
    then use only keywords the grammar engine enforces."""
    from .structured import check_schema

    if chat.tool_choice != "required" and chat.forced_tool is None:
        return
    for i, tool in enumerate(chat.tools or []):
        if chat.forced_tool in (None, tool["function"]["name"]):
            check_schema(tool["function"].get("parameters", {}), f"tools[{i}].function.parameters", param="tools")


def parse_tool_choice(choice: Any, tools: list[dict] | None, where: str) -> str | dict:
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ProtocolError(f"'{where}' must be auto, none, required or a named function, got {choice!r}", where,
                                "invalid_value")
        if choice == "required" and not tools:
            raise ProtocolError(f"'{where}' is required but no tools are given", where, "invalid_value")
        return choice
    if (not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict)
            or not isinstance(choice["function"].get("name"), str)):
        raise ProtocolError(f"a named '{where}' is {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", where,
                            "invalid_value")
    name = choice["function"]["name"]
    if not any(t["function"]["name"] == name for t in tools or []):
        raise ProtocolError(f"'{where}' names the function {name!r}, which is not among the tools", where,
                            "invalid_value")
    return {"type": "function", "function": {"name": name}}


def _options(body: dict) -> ChatOptions:
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ProtocolError("'chat_template_kwargs' must be an object", "chat_template_kwargs", "invalid_type")
    unknown = sorted(set(kwargs) - set(TEMPLATE_SWITCHES))
    if unknown:
        raise ProtocolError(f"'chat_template_kwargs' may set only {', '.join(TEMPLATE_SWITCHES)}; got "
                            f"{', '.join(unknown)}", "chat_template_kwargs", "unsupported")
    thinking = [kwargs[k] for k in ("thinking", "enable_thinking") if k in kwargs]
    if any(not isinstance(t, bool) for t in thinking) or len(set(thinking)) > 1:
        raise ProtocolError("'chat_template_kwargs.thinking' / 'enable_thinking' must be one boolean",
                            "chat_template_kwargs", "invalid_value")
    drop = kwargs.get("drop_thinking")
    if drop is not None and not isinstance(drop, bool):
        raise ProtocolError("'chat_template_kwargs.drop_thinking' must be a boolean", "chat_template_kwargs",
                            "invalid_type")
    effort = body.get("reasoning_effort", kwargs.get("reasoning_effort"))
    if "reasoning_effort" in body and "reasoning_effort" in kwargs and body["reasoning_effort"] != kwargs["reasoning_effort"]:
        raise ProtocolError("'reasoning_effort' and 'chat_template_kwargs.reasoning_effort' disagree",
                            "reasoning_effort", "invalid_value")
    if effort is not None and (isinstance(effort, bool) or not isinstance(effort, (str, int))):
        raise ProtocolError("'reasoning_effort' must be a string or an integer", "reasoning_effort", "invalid_type")
    add_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_prompt, bool):
        raise ProtocolError("'add_generation_prompt' must be a boolean", "add_generation_prompt", "invalid_type")
    return ChatOptions(thinking[0] if thinking else None, effort, drop, add_prompt)
