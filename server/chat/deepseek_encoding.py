"""DeepSeek-V4 and V4.1's chat encoding: OpenAI-style messages to the prompt string.

The releases ship no Jinja template; their prompt format is a Python encoder
(`encoding/encoding_dsv4.py` of DeepSeek-V4-Flash, `encoding/encoding.py` of DeepSeek-V4.1-Flash).
This is an independent implementation of the same rules, checked byte for byte against the golden
prompts in `shared/golden/deepseek-encoding/`. Message checking and the tool-result merge live in
`deepseek_messages`, DSML in `dsml`.

Rules (both versions unless marked):
- The prompt is BOS, then each turn in order. system: its text (V4.1: after `<｜System｜>`, which
  also opens a mid-conversation system message); developer (V4): `<｜User｜>` + text; user:
  `<｜User｜>` + parts; latest_reminder: `<｜latest_reminder｜>` + text; assistant: reasoning part +
  content + DSML tool calls + EOS (no EOS when the message sets `wo_eos`).
- `tools` on a system/developer message append "\\n\\n## Tools..." (see `deepseek_format`),
  `response_format` appends "\\n\\n## Response Format...". Request-level `tools` go on the first
  message when it is a system (V4: or developer) message, else in a new empty system message in
  front, as vLLM's DeepSeek tokenizers do (the official test puts them on `messages[0]`).
- A user turn (V4: also developer; V4.1: also a system message after the first) followed by an
  assistant/latest_reminder turn, or ending the conversation, is followed by the assistant
  header `<｜Assistant｜>` + `<think>` (thinking mode, at or after the last user turn, or always when
  reasoning is kept) or `</think>`. A message's `task` replaces the header by its task token
  (`action`: `<｜Assistant｜>` + think token + `<｜action｜>`), and the reply to a task has no
  reasoning part.
- Reasoning is kept (`reasoning</think>` before the content) in thinking mode for assistant turns
  after the last user turn, or for all turns when `drop_thinking` is false or when any message
  carries tools. Otherwise, in thinking mode, reasoning before the last user turn is dropped and
  V4 also drops developer messages before it (and both drop unknown roles there instead of
  refusing them). Chat mode never renders reasoning.
- Reasoning effort, V4: None and "high" add nothing, "max" prefixes the first message with the
  "Absolute maximum" paragraph in thinking mode; anything else is an error (a caller maps the
  OpenAI value "none" to chat mode). V4.1: an int 1..100 or low=50 / high=75 / max=100, default
  75 (no "xhigh"); in thinking mode the first message is prefixed by
  `<｜System｜>Reasoning Effort: N (...)\\n\\n`. The effort is checked in chat mode too.
- Special tokens or DSML typed into message text are kept verbatim, as DeepSeek's encoders do
  (neither escapes nor refuses them; V4.1 only refuses its image token). The tokenizer then reads
  them as the special tokens they spell, exactly as in DeepSeek's own pipeline.
"""

from __future__ import annotations

from typing import Any

from server.chat import deepseek_format as fmt
from server.chat.deepseek_messages import EncodingError, Turn, conversation_turns
from server.chat.dsml import render_tool_calls, to_json

__all__ = ["EncodingError", "encode_messages", "generation_suffix", "resolve_effort"]


def generation_suffix(thinking_mode: str) -> str:
    """What follows the final `<｜Assistant｜>`: the text the model's completion continues from."""
    _check_mode(thinking_mode)
    return fmt.THINK_START if thinking_mode == "thinking" else fmt.THINK_END


def _check_mode(thinking_mode: str) -> None:
    if thinking_mode not in fmt.THINKING_MODES:
        raise EncodingError(f"thinking_mode must be 'chat' or 'thinking', not {thinking_mode!r}")


def resolve_effort(version: str, reasoning_effort: Any) -> str | int | None:
    """The effort as the encoder uses it (V4: None | "high" | "max"; V4.1: 1..100).

    The OpenAI value "none" is not an effort: the caller turns it into `thinking_mode="chat"`.
    """
    if version not in fmt.VERSIONS:
        raise EncodingError(f"version must be 'v4' or 'v41', not {version!r}")
    if version == "v4":
        if reasoning_effort not in (None, "high", "max"):
            raise EncodingError(f"reasoning_effort for DeepSeek-V4 must be 'high', 'max' or "
                                f"unset, not {reasoning_effort!r}")
        return reasoning_effort
    if reasoning_effort is None:
        return fmt.V41_DEFAULT_EFFORT
    if type(reasoning_effort) is int and 1 <= reasoning_effort <= 100:
        return reasoning_effort
    if isinstance(reasoning_effort, str) and reasoning_effort in fmt.V41_EFFORT_LEVELS:
        return fmt.V41_EFFORT_LEVELS[reasoning_effort]
    raise EncodingError(f"reasoning_effort for DeepSeek-V4.1 must be an integer 1-100 or one of "
                        f"{sorted(fmt.V41_EFFORT_LEVELS)}, not {reasoning_effort!r}")


def _last_user_index(turns: list[Turn], version: str) -> int:
    for index in range(len(turns) - 1, -1, -1):
        if _opens_reply(turns, index, version):
            return index
    return -1


def _opens_reply(turns: list[Turn], index: int, version: str) -> bool:
    """True for the turns an assistant reply follows: user, V4 developer, V4.1 later system."""
    role = turns[index].role
    if version == "v4":
        return role in ("user", "developer")
    return role == "user" or (role == "system" and index > 0)


def _drop_earlier_thinking(turns: list[Turn], version: str) -> list[Turn]:
    """Thinking mode without kept reasoning: strip reasoning before the last user turn, and drop
    the turns there that are neither user, system, latest_reminder nor assistant (V4's developer
    messages, unknown roles)."""
    last_user = _last_user_index(turns, version)
    kept = []
    for index, turn in enumerate(turns):
        if index >= last_user or turn.role in ("user", "system", "latest_reminder"):
            kept.append(turn)
        elif turn.role == "assistant":
            kept.append(Turn(**{**vars(turn), "reasoning": None}))
    return kept


class _Renderer:
    def __init__(self, turns: list[Turn], version: str, thinking: bool, keep_reasoning: bool,
                 effort: str | int | None) -> None:
        self.turns, self.version, self.thinking = turns, version, thinking
        self.keep_reasoning, self.effort = keep_reasoning, effort
        self.tags = fmt.DSML_TAGS[version]
        self.last_user = _last_user_index(turns, version)

    def _effort_prefix(self, index: int) -> str:
        if index != 0 or not self.thinking:
            return ""
        if self.version == "v4":
            return fmt.V4_MAX_EFFORT_TEXT if self.effort == "max" else ""
        return fmt.v41_effort_text(int(self.effort))

    def _extras(self, turn: Turn) -> str:
        text = ""
        if turn.tools:
            schemas = [to_json(tool["function"]) for tool in turn.tools]
            text += "\n\n" + fmt.tools_section(self.version, schemas)
        if turn.response_format:
            text += "\n\n" + fmt.response_format_section(to_json(turn.response_format))
        return text

    def _assistant(self, index: int, turn: Turn) -> str:
        after_task = index > 0 and self.turns[index - 1].task is not None
        reasoning = ""
        if self.thinking and not after_task and (self.keep_reasoning or index > self.last_user):
            reasoning = (turn.reasoning or "") + fmt.THINK_END
        calls = render_tool_calls(turn.tool_calls, self.tags, self.version) if turn.tool_calls \
            else ""
        return reasoning + turn.text + calls + ("" if turn.wo_eos else fmt.EOS)

    def _body(self, index: int, turn: Turn) -> str:
        if turn.role == "system":
            opener = fmt.SYSTEM if self.version == "v41" and index > 0 else ""
            return opener + turn.text + self._extras(turn)
        if turn.role == "developer" and self.version == "v4":
            if not turn.text:  # checked where rendered, as DeepSeek's encoder does
                raise EncodingError(f"messages[{turn.source}]: a developer message needs "
                                    "non-empty content")
            return fmt.USER + turn.text + self._extras(turn)
        if turn.role == "user":
            return fmt.USER + "\n\n".join(part.text for part in turn.parts)
        if turn.role == "latest_reminder":
            return fmt.LATEST_REMINDER + turn.text
        if turn.role == "assistant":
            return self._assistant(index, turn)
        hint = "; send it as system" if turn.role == "developer" else ""
        raise EncodingError(f"messages[{turn.source}]: unknown role {turn.role!r} for "
                            f"DeepSeek-{'V4' if self.version == 'v4' else 'V4.1'}{hint}")

    def _transition(self, index: int, turn: Turn) -> str:
        following = self.turns[index + 1].role if index + 1 < len(self.turns) else None
        if following not in (None, "assistant", "latest_reminder"):
            return ""
        if turn.task is not None:
            token = fmt.TASK_TOKENS[turn.task]
            if turn.task != "action":
                return token
            return fmt.ASSISTANT + (fmt.THINK_START if self.thinking else fmt.THINK_END) + token
        if not _opens_reply(self.turns, index, self.version):
            return ""
        think = self.thinking and (self.keep_reasoning or index >= self.last_user)
        return fmt.ASSISTANT + (fmt.THINK_START if think else fmt.THINK_END)

    def render(self, index: int) -> str:
        turn = self.turns[index]
        effort = self._effort_prefix(index)
        opener = fmt.SYSTEM if self.version == "v41" and index == 0 and (
            effort or turn.role == "system") else ""
        return opener + effort + self._body(index, turn) + self._transition(index, turn)


def encode_messages(
    messages: list[dict],
    *,
    version: str,
    thinking_mode: str,
    reasoning_effort: str | int | None = None,
    drop_thinking: bool = True,
    tools: list[dict] | None = None,
    add_bos: bool = True,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt DeepSeek's `encode_messages` builds for `messages` (see the module docstring).

    `add_generation_prompt=False` removes a trailing `<｜Assistant｜><think>` / `</think>` header
    (for /tokenize); DeepSeek's encoder always writes it after a final user turn.
    """
    if version not in fmt.VERSIONS:
        raise EncodingError(f"version must be 'v4' or 'v41', not {version!r}")
    _check_mode(thinking_mode)
    effort = resolve_effort(version, reasoning_effort)
    turns = conversation_turns(messages, version, request_tools=tools)
    thinking = thinking_mode == "thinking"
    keep_reasoning = not drop_thinking or any(turn.tools for turn in turns)
    if thinking and not keep_reasoning:
        turns = _drop_earlier_thinking(turns, version)
    renderer = _Renderer(turns, version, thinking, keep_reasoning, effort)
    prompt = (fmt.BOS if add_bos else "") + "".join(renderer.render(i) for i in range(len(turns)))
    header = fmt.ASSISTANT + generation_suffix(thinking_mode)
    if not add_generation_prompt and prompt.endswith(header):
        prompt = prompt[: -len(header)]
    return prompt
