"""Turning a `ChatRequest` into the prompt text, by model family (`--tokenizer-mode`):

- `deepseek_v4` / `deepseek_v41`: DeepSeek's own chat encoding (server/chat/), as the releases'
  Python encoders write it — thinking on by default (as vLLM's DeepSeek modes), reasoning
  effort, tools in the system prompt, tool calls in DSML, tool results as <tool_result> blocks;
  the output is read by the DeepSeek output processor (reasoning, content, tool calls);
- `hf`: the tokenizer's Jinja chat template (sandboxed: server/tokenizer.py), for other
  tokenizers; plain text out, no tools, no reasoning switches;
- `auto`: DeepSeek's encoding for a DeepSeek-V4 / V4.1 checkpoint, else the Jinja template.

Also here: the grammar a tool choice needs (`required` or a named function: xgrammar's DeepSeek
structural tags, compiled by the engine) and where a response format's grammar starts in a
thinking model's output (after the end-of-reasoning token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from msgspec.structs import replace

from ipc.messages import StructuredOutput

from .chat import EncodingError, encode_messages, resolve_effort
from .chat import deepseek_format as fmt
from .chat_request import ChatRequest
from .errors import ProtocolError

TOKENIZER_MODES = ("auto", "deepseek_v4", "deepseek_v41", "hf")
_VERSIONS = {"deepseek_v4": "v4", "deepseek_v41": "v41"}
_XGRAMMAR_MODELS = {"v4": "deepseek_v4", "v41": "deepseek_v4_1"}  # xgrammar's built-in structural tags


@dataclass(frozen=True)
class Rendered:
    text: str
    family: str  # "deepseek_v4" | "deepseek_v41" | "hf"
    thinking: bool  # the output starts inside the reasoning section

    @property
    def version(self) -> str | None:
        return _VERSIONS.get(self.family)


def resolve_mode(mode: str, model_type: str) -> str:
    """The family a --tokenizer-mode serves for a checkpoint's model_type."""
    if mode not in TOKENIZER_MODES:
        raise ValueError(f"--tokenizer-mode must be one of {', '.join(TOKENIZER_MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    return model_type if model_type in _VERSIONS else "hf"


class ChatRenderer:
    def __init__(self, family: str, tokenizer):
        self.family, self.tokenizer = family, tokenizer
        self.version = _VERSIONS.get(family)
        self.think_end_id = tokenizer.token_to_id(fmt.THINK_END) if self.version else None

    @property
    def renders_images(self) -> bool:
        """The format has an image placeholder (DeepSeek-V4.1's encoder; V4's and Jinja's do not)."""
        return self.version == "v41"

    def render(self, chat: ChatRequest) -> Rendered:
        """The prompt text (ProtocolError 400 for what the format cannot say)."""
        if self.version is None:
            return self._jinja(chat)
        opts = chat.options
        thinking = True if opts.thinking is None else opts.thinking
        effort = opts.reasoning_effort
        if effort == "none":  # OpenAI's "no reasoning": DeepSeek's chat mode
            thinking, effort = False, None
        messages = chat.messages
        if self.version == "v41":  # V4.1's encoder has no developer role: OpenAI clients' instructions are system
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        try:
            effort = resolve_effort(self.version, effort)
            text = encode_messages(messages, version=self.version, thinking_mode="thinking" if thinking else "chat",
                                   reasoning_effort=effort, drop_thinking=True if opts.drop_thinking is None
                                   else opts.drop_thinking, tools=chat.tools,
                                   add_generation_prompt=opts.add_generation_prompt)
        except EncodingError as exc:
            param = "reasoning_effort" if "reasoning_effort" in str(exc) else "messages"
            raise ProtocolError(str(exc), param, "invalid_value") from None
        return Rendered(text, self.family, thinking and opts.add_generation_prompt)

    def _jinja(self, chat: ChatRequest) -> Rendered:
        if chat.tools:
            raise ProtocolError("tool calling needs DeepSeek's chat format (--tokenizer-mode deepseek_v4 or "
                                "deepseek_v41); this server renders the tokenizer's chat template", "tools",
                                "unsupported")
        opts = chat.options
        if opts.thinking is not None or opts.reasoning_effort is not None or opts.drop_thinking is not None:
            raise ProtocolError("reasoning switches need DeepSeek's chat format (--tokenizer-mode deepseek_v4 or "
                                "deepseek_v41)", "chat_template_kwargs", "unsupported")
        try:
            text = self.tokenizer.apply_chat_template(chat.messages, opts.add_generation_prompt)
        except ValueError as exc:
            raise ProtocolError(str(exc), "messages", "invalid_value") from None
        return Rendered(text, self.family, False)

    # ---- grammars ------------------------------------------------------------------------------------
    def grammar(self, chat: ChatRequest, rendered: Rendered, structured: StructuredOutput | None
                ) -> StructuredOutput | None:
        """The request's grammar: a tool choice that forces calls (xgrammar's structural tag for
        DeepSeek's DSML, reasoning section included), or its response format's grammar, started
        after the reasoning when the output begins inside it."""
        forcing = chat.tool_choice == "required" or chat.forced_tool is not None
        if forcing and structured is not None:
            raise ProtocolError("a forced tool choice and a response format both constrain the output; give one",
                                "tool_choice", "invalid_value")
        if forcing:
            spec = {"model": _XGRAMMAR_MODELS[self.version], "tools": chat.tools, "tool_choice": chat.tool_choice,
                    "reasoning": rendered.thinking, "parallel_tool_calls": chat.parallel_tool_calls}
            return StructuredOutput("tool_calls", json.dumps(spec, ensure_ascii=False))
        if structured is None or not rendered.thinking:
            return structured
        if self.think_end_id is None:
            raise ProtocolError(f"a response format in thinking mode needs {fmt.THINK_END} as one token of the "
                                "tokenizer; turn thinking off (chat_template_kwargs.thinking: false)",
                                "response_format", "unsupported")
        return replace(structured, start_after=self.think_end_id)
