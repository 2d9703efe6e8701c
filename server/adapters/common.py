"""What the Anthropic and Responses adapters share: a translated request's run on the chat path
(`ChatRun`), its errors in the caller's own field names (`Translation`), the reasoning-effort
table, and server-sent events.

Reasoning effort. Both APIs name levels (Anthropic `output_config.effort`: low, medium, high,
xhigh, max; OpenAI `reasoning.effort`: none, minimal, low, medium, high, xhigh, max); DeepSeek's
encoders take their own (server/chat/deepseek_encoding.py `resolve_effort`):
- V4 knows `high` (its default: no effort text) and `max` (the "Absolute maximum" paragraph);
  there is nothing below high, so every level up to xhigh is `high`, and `max` is `max`.
- V4.1 takes 1–100 with the official names low 50 / high 75 / max 100; the levels DeepSeek does
  not name sit between them: minimal 25, medium 63, xhigh 88.
- OpenAI's `none` is no reasoning at all: DeepSeek's chat mode (as `reasoning_effort: "none"` on
  chat completions). A tokenizer-template model (`hf`) has no reasoning switch: levels are ignored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field

from aiohttp import web

from ..chat import MessageDone, OutputEvent
from ..chat_output import ChatOutput
from ..errors import ProtocolError
from ..handlers import prepare_chat, session_of
from ..protocol import GenerationRequest, parse_chat
from ..run import Generation, engine_error
from ..state import STATE, AppState

logger = logging.getLogger(__name__)

EFFORT_LEVELS = ("minimal", "low", "medium", "high", "xhigh", "max")
_EFFORT = {
    "v4": {"minimal": "high", "low": "high", "medium": "high", "high": "high", "xhigh": "high", "max": "max"},
    "v41": {"minimal": 25, "low": 50, "medium": 63, "high": 75, "xhigh": 88, "max": 100},
}


def reasoning_fields(version: str | None, thinking: bool | None, effort: str | None, where: str) -> dict:
    """The chat body's reasoning switches for a thinking on/off choice (None: the model's
    default) and an effort level (None: the model's default), for the served model family."""
    if version is None:  # the tokenizer's own template: no reasoning switches to set
        return {}
    out: dict = {}
    if effort is not None:
        table = _EFFORT[version]
        if effort not in table:
            raise ProtocolError(f"'{where}' must be one of {', '.join(table)}, got {effort!r}", where, "invalid_value")
        out["reasoning_effort"] = table[effort]
    if thinking is not None:
        out["chat_template_kwargs"] = {"thinking": thinking}
    return out


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


@dataclass
class Translation:
    """An API request as an OpenAI chat-completions body, with what it takes to report the chat
    path's errors in the API's own terms."""

    body: dict
    params: dict[str, str] = field(default_factory=dict)  # chat field → this API's field
    renames: tuple[tuple[str, str], ...] = ()  # (chat spelling, this API's) in error messages
    sources: list[str] = field(default_factory=list)  # per chat message: where it came from ("messages[2]")

    def error(self, exc: ProtocolError) -> ProtocolError:
        message, param = exc.message, self.params.get(exc.param, exc.param)
        for ours, theirs in self.renames:
            message = message.replace(ours, theirs)
        # messages[N] of the chat body → the place in this API's request that produced it
        message = re.sub(r"messages\[(\d+)\]",
                         lambda m: self.sources[int(m[1])] if int(m[1]) < len(self.sources) else m[0], message)
        return ProtocolError(message, param, exc.code, exc.status, exc.err_type)

    @contextmanager
    def api_names(self):
        try:
            yield
        except ProtocolError as exc:
            raise self.error(exc) from None


class ChatRun:
    """One adapter request on the chat path: parsed and prepared exactly as a chat request
    (`prepare`), run as one engine choice (`start` inside admission), its text read into
    output events (`events`); afterwards the finish, the stop string and the token counts."""

    def __init__(self, state: AppState, req: GenerationRequest, ids: list[int], output: ChatOutput):
        self.state, self.req, self.ids, self.output = state, req, ids, output
        self.gen: Generation | None = None
        self.message: dict | None = None  # the final message (MessageDone)
        self.tools_called = False

    @classmethod
    async def prepare(cls, request: web.Request, translation: Translation) -> ChatRun:
        state = request.app[STATE]
        with translation.api_names():
            req = parse_chat(translation.body, state.limits, state.served_names)
            req.user = session_of(request, req.user)
            ids, rendered = await prepare_chat(state, req)
        output = ChatOutput(rendered, req.chat.parses_tool_calls, state.renderer.think_end_id)
        return cls(state, req, ids, output)

    def start(self) -> None:
        self.gen = Generation(self.state, self.req, [self.ids], keep_special_tokens=self.output.keeps_special_tokens)

    async def events(self) -> AsyncIterator[OutputEvent]:
        """Reasoning, content and tool-call events until the choice ends (MessageDone is kept
        in `message`, not yielded). Use inside `aclosing`: leaving early aborts the request."""
        async with aclosing(self.gen.events()) as events:
            async for event in events:
                if event.error is not None:  # refused or failed before any output
                    raise event.error
                state = event.choice.state
                out = self.output.feed(event.text)
                if event.last:
                    if state.finish_reason == "error" and state.error:  # failed after some output
                        raise engine_error(state.error, state.error_code)
                    out += self.output.finish()
                for item in out:
                    if isinstance(item, MessageDone):
                        self.message, self.tools_called = item.message, item.tools_called
                    else:
                        yield item

    # ---- after the events ------------------------------------------------------------------------
    @property
    def finish_reason(self) -> str:
        """OpenAI's finish reason: stop, length, tool_calls, or abort (the request deadline)."""
        reason = self.gen.choices[0].state.finish_reason or "abort"
        return "tool_calls" if reason == "stop" and self.tools_called else reason

    def stop_sequence(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self.gen.choices[0].state.stop_string if self.gen is not None else None

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)

    @property
    def cached_tokens(self) -> int:
        return self.gen.choices[0].state.cached_tokens if self.gen is not None else 0

    @property
    def output_tokens(self) -> int:
        return len(self.gen.choices[0].state.token_ids) if self.gen is not None else 0

    @property
    def reasoning_tokens(self) -> int:
        return self.output.reasoning_tokens(self.gen.choices[0].state.token_ids) if self.gen is not None else 0


# ---- server-sent events ------------------------------------------------------------------------------

def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def stream_events(request: web.Request, events: AsyncIterator[tuple[str, dict]],
                        error_events: Callable[[ProtocolError], list[tuple[str, dict]]]) -> web.StreamResponse:
    """Write (event, data) pairs as server-sent events. A failure after the 200 becomes the
    API's error events, written last; a client that went away just ends the stream."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    try:
        async with aclosing(events) as pairs:  # leaving early cancels the request's choice
            async for event, data in pairs:
                await resp.write(sse(event, data))
    except ConnectionResetError:
        logger.info("%s stream: client disconnected", request.path)
        return resp
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # never a half-written stream without a reason
        if not isinstance(exc, ProtocolError):
            logger.exception("%s stream failed", request.path)
            exc = ProtocolError(f"internal error: {type(exc).__name__}", None, "internal_error", status=500,
                                err_type="server_error")
        for event, data in error_events(exc):
            await resp.write(sse(event, data))
    await resp.write_eof()
    return resp
