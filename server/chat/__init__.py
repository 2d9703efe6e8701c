"""DeepSeek-V4 / V4.1 chat format: the prompt encoder and the readers of model output.

- `encode_messages` (deepseek_encoding): OpenAI-style messages to DeepSeek's prompt string.
- `parse_completion` (completion_parser): DeepSeek's own strict reading of a completion.
- `DeepSeekOutputProcessor` / `parse_completion_lenient` (output_parser): the streaming reader
  for serving, which never raises on model text.
"""

from server.chat.completion_parser import CompletionParseError, parse_completion
from server.chat.deepseek_encoding import (
    EncodingError,
    encode_messages,
    generation_suffix,
    resolve_effort,
)
from server.chat.output_parser import (
    ContentDelta,
    DeepSeekOutputProcessor,
    MessageDone,
    OutputEvent,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallStart,
    new_tool_call_id,
    parse_completion_lenient,
)

__all__ = [
    "CompletionParseError",
    "ContentDelta",
    "DeepSeekOutputProcessor",
    "EncodingError",
    "MessageDone",
    "OutputEvent",
    "ReasoningDelta",
    "ToolCallArgumentsDelta",
    "ToolCallStart",
    "encode_messages",
    "generation_suffix",
    "new_tool_call_id",
    "parse_completion",
    "parse_completion_lenient",
    "resolve_effort",
]
