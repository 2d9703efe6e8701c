"""One choice's chat output, as every chat API reads it: text deltas in, typed events out.

For DeepSeek's format the text (decoded with special tokens kept) goes through
`DeepSeekOutputProcessor` (server/chat/output_parser.py): reasoning, content and DSML tool calls,
nothing of the markup leaked, the same events for any chunking. For a Jinja-template model the
text is all content. The reasoning's length in tokens (for `reasoning_tokens` in usage) is
counted on the tokens themselves: those before the end-of-reasoning token.
"""

from __future__ import annotations

from .chat import ContentDelta, DeepSeekOutputProcessor, MessageDone, OutputEvent
from .chat_render import Rendered


class ChatOutput:
    def __init__(self, rendered: Rendered, parse_tool_calls: bool, think_end_id: int | None):
        self.rendered = rendered
        self.think_end_id = think_end_id
        self._processor = (DeepSeekOutputProcessor(rendered.version, "thinking" if rendered.thinking else "chat",
                                                   parse_tool_calls=parse_tool_calls)
                           if rendered.version is not None else None)
        self._content: list[str] = []

    @property
    def keeps_special_tokens(self) -> bool:
        """Decode the output with special tokens as text (the markup the processor reads)."""
        return self._processor is not None

    def feed(self, text: str) -> list[OutputEvent]:
        if not text:
            return []
        if self._processor is None:
            self._content.append(text)
            return [ContentDelta(text)]
        return self._processor.feed(text)

    def finish(self) -> list[OutputEvent]:
        """The last events; the final one is MessageDone with the whole message."""
        if self._processor is None:
            content = "".join(self._content)
            return [MessageDone({"role": "assistant", "content": content, "reasoning_content": None,
                                 "tool_calls": []}, False)]
        return self._processor.finish()

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """Output tokens inside the reasoning section (the end-of-reasoning token excluded)."""
        if not self.rendered.thinking:
            return 0
        if self.think_end_id is not None and self.think_end_id in token_ids:
            return token_ids.index(self.think_end_id)
        return len(token_ids)  # cut before the reasoning ended: all of it
