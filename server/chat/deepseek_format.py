"""The fixed strings of DeepSeek-V4 / V4.1's chat format: special tokens, DSML tag spellings,
the tools section and the reasoning-effort texts.

Source of every string: the releases' own encoders (`encoding/encoding_dsv4.py` of
DeepSeek-V4-Flash, `encoding/encoding.py` of DeepSeek-V4.1-Flash) as reproduced byte for byte by
the golden prompts in `shared/golden/deepseek-encoding/`. `｜` is U+FF5C and `▁` is U+2581.

V4 and V4.1 differ in three places kept here: V4.1 puts a space in front of each DSML tag name
(`<｜DSML｜ calls>` for V4's `<｜DSML｜tool_calls>`), V4.1 has a `<｜System｜>` token, and the
reasoning-effort texts (V4: one "max" paragraph; V4.1: a numeric budget line).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Version = Literal["v4", "v41"]
ThinkingMode = Literal["chat", "thinking"]
VERSIONS: tuple[str, ...] = ("v4", "v41")
THINKING_MODES: tuple[str, ...] = ("chat", "thinking")

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"  # V4.1 only
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"  # V4.1 only

# DeepSeek's internal "quick instruction" tasks, set as `task` on a user message.
TASK_TOKENS: dict[str, str] = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}


@dataclass(frozen=True)
class DsmlTags:
    """One version's spelling of the three DSML tag names (V4.1's start with a space)."""

    block: str
    invoke: str
    parameter: str

    @property
    def block_open(self) -> str:
        return f"<{DSML}{self.block}>"

    @property
    def block_close(self) -> str:
        return f"</{DSML}{self.block}>"

    @property
    def invoke_open(self) -> str:  # followed by ` name="...">`
        return f"<{DSML}{self.invoke}"

    @property
    def invoke_close(self) -> str:
        return f"</{DSML}{self.invoke}>"

    @property
    def parameter_open(self) -> str:  # followed by ` name="..." string="true|false">`
        return f"<{DSML}{self.parameter}"

    @property
    def parameter_close(self) -> str:
        return f"</{DSML}{self.parameter}>"


DSML_TAGS: dict[str, DsmlTags] = {
    "v4": DsmlTags(block="tool_calls", invoke="invoke", parameter="parameter"),
    "v41": DsmlTags(block=" calls", invoke=" invoke", parameter=" parameter"),
}


def tools_section(version: str, tool_schemas_json: list[str]) -> str:
    """The "## Tools" text appended (after a blank line) to the message that carries `tools`."""
    t = DSML_TAGS[version]
    return (
        "## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. "
        f'You can invoke tools by writing a "{t.block_open}" block like the following:\n\n'
        f"{t.block_open}\n"
        f'{t.invoke_open} name="$TOOL_NAME">\n'
        f'{t.parameter_open} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
        f"{t.parameter_close}\n"
        "...\n"
        f"{t.invoke_close}\n"
        f'{t.invoke_open} name="$TOOL_NAME2">\n'
        "...\n"
        f"{t.invoke_close}\n"
        f"{t.block_close}\n\n"
        'String parameters should be specified as is and set `string="true"`. For all other '
        "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
        '`string="false"`.\n\n'
        f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete "
        f"reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
        f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
        + "\n".join(tool_schemas_json)
        + "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to "
        "invoke tool calls.\n"
    )


def response_format_section(schema_json: str) -> str:
    """The text appended (after a blank line) to a system/developer message's `response_format`."""
    return (
        "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        + schema_json
    )


# V4: "max" effort prepends this paragraph to the first message in thinking mode.
V4_MAX_EFFORT_TEXT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)

# V4.1: the numeric budget line that follows `<｜System｜>` in thinking mode.
V41_EFFORT_LEVELS: dict[str, int] = {"low": 50, "high": 75, "max": 100}
V41_DEFAULT_EFFORT = 75


def v41_effort_text(budget: int) -> str:
    return (
        f"Reasoning Effort: {budget} "
        "(range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    )
