"""Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and
`POST /v1/messages/count_tokens`, on the chat path (request: anthropic_request.py).

The reply's content is built from the chat output's events: a `thinking` block for the
reasoning, a `text` block for the answer, one `tool_use` block per tool call (its `input` the
call's arguments), a new block whenever the kind changes. Streamed, that is `message_start`,
`ping`, per block `content_block_start` / `content_block_delta` (`thinking_delta` — then one
`signature_delta` —, `text_delta`, `input_json_delta`) / `content_block_stop`, then
`message_delta` (stop reason and usage) and `message_stop`; whole, the same blocks.

Stop reasons: a tool call → `tool_use`; a stop sequence → `stop_sequence` (with the string);
the end of the turn (EOS) → `end_turn`; `max_tokens` → `max_tokens`; a request cut by the server's
deadline → `max_tokens` too (its output is truncated). Usage as Anthropic counts it: the prefix-cache
hit is `cache_read_input_tokens` and `input_tokens` the rest of the prompt (the three input
counts add up to the prompt); `output_tokens_details.thinking_tokens` the reasoning's tokens.
Thinking blocks carry an opaque signature (Anthropic clients expect one); one sent back is ignored.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from aiohttp import web

from .. import offload
from ..chat import ContentDelta, OutputEvent, ReasoningDelta, ToolCallArgumentsDelta, ToolCallStart
from ..errors import ProtocolError
from ..handlers import chat_prompt_ids, read_json
from ..protocol import parse_chat
from ..state import STATE
from .anthropic_request import translate
from .common import ChatRun, new_id, stream_events

ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                500: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "max_tokens"}


def is_anthropic_route(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(status: int, message: str) -> dict:
    """Anthropic's error body for an HTTP status."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _error_events(exc: ProtocolError) -> list[tuple[str, dict]]:
    return [("error", error_body(exc.status, exc.message))]


async def messages(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    run = await ChatRun.prepare(request, translate(await read_json(request), state.renderer.version))
    with state.admit(1):  # raises 429/503 when overloaded or draining
        run.start()
        reply = _Reply(run)
        if run.req.stream:
            return await stream_events(request, reply.stream(), _error_events)
        return web.json_response(await reply.whole())


async def count_tokens(request: web.Request) -> web.Response:
    """The rendered prompt's length in tokens: what `input_tokens` of the same request would be
    before any prefix-cache hit."""
    state = request.app[STATE]
    translation = translate(await read_json(request), state.renderer.version, count_only=True)
    with translation.api_names():
        req = parse_chat(translation.body, state.limits, state.served_names)
        ids = await chat_prompt_ids(state, req.chat)  # with images: their spans expanded
        if ids is None:
            rendered = await offload.run(state.renderer.render, req.chat)
    if ids is None:
        ids = await offload.encode(state.tokenizer, rendered.text, add_bos=False)  # the text holds its BOS
    return web.json_response({"input_tokens": len(ids)})


class _Reply:
    def __init__(self, run: ChatRun):
        self.run = run
        self.id = new_id("msg_")
        self.blocks = _Blocks()

    async def whole(self) -> dict:
        async with aclosing(self.run.events()) as events:
            async for event in events:
                self.blocks.feed(event)
        self.blocks.close()
        return self._message(self.blocks.content, *self._stop(), self._usage())

    async def stream(self) -> AsyncIterator[tuple[str, dict]]:
        started = {"input_tokens": self.run.prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                   "cache_creation_input_tokens": 0}  # the cache hit is known at the end: message_delta
        yield "message_start", {"type": "message_start", "message": self._message([], None, None, started)}
        yield "ping", {"type": "ping"}
        async with aclosing(self.run.events()) as events:
            async for event in events:
                for pair in self.blocks.feed(event):
                    yield pair
        for pair in self.blocks.close():
            yield pair
        reason, sequence = self._stop()
        yield "message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                "usage": self._usage()}
        yield "message_stop", {"type": "message_stop"}

    def _message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.run.req.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def _stop(self) -> tuple[str, str | None]:
        reason = self.run.finish_reason
        sequence = self.run.stop_sequence() if reason == "stop" else None
        return ("stop_sequence", sequence) if sequence is not None else (_STOP_REASONS.get(reason, "end_turn"), None)

    def _usage(self) -> dict:
        run = self.run
        return {"input_tokens": run.prompt_tokens - run.cached_tokens, "output_tokens": run.output_tokens,
                "cache_read_input_tokens": run.cached_tokens, "cache_creation_input_tokens": 0,
                "output_tokens_details": {"thinking_tokens": run.reasoning_tokens}}


class _Blocks:
    """Output events → Anthropic content blocks. `feed` and `close` return the stream's events
    (name, data); `content` accumulates the same blocks for the whole message."""

    def __init__(self):
        self.content: list[dict] = []
        self._open: str | None = None  # the kind of content[-1] while it is open
        self._arguments = ""  # the open tool_use block's JSON, as streamed

    def feed(self, event: OutputEvent) -> list[tuple[str, dict]]:
        if isinstance(event, ReasoningDelta):
            return self._add_text("thinking", event.text)
        if isinstance(event, ContentDelta):
            return self._add_text("text", event.text)
        if isinstance(event, ToolCallStart):
            return self.close() + self._start({"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
        if isinstance(event, ToolCallArgumentsDelta):
            self._arguments += event.arguments
            return [self._delta({"type": "input_json_delta", "partial_json": event.arguments})]
        return []

    def close(self) -> list[tuple[str, dict]]:
        """End the open block (a thinking block gets its signature first)."""
        if self._open is None:
            return []
        index, block, out = len(self.content) - 1, self.content[-1], []
        if self._open == "thinking":
            block["signature"] = new_id("")
            out.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        elif self._open == "tool_use":
            block["input"] = json.loads(self._arguments) if self._arguments else {}
            self._arguments = ""
        self._open = None
        return out + [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _add_text(self, kind: str, text: str) -> list[tuple[str, dict]]:
        if not text:
            return []
        out = []
        if self._open != kind:
            empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text",
                                                                                                      "text": ""}
            out = self.close() + self._start(empty)
        self.content[-1][kind] += text
        return out + [self._delta({"type": f"{kind}_delta", kind: text})]

    def _start(self, block: dict) -> list[tuple[str, dict]]:
        self.content.append(block)
        self._open = block["type"]
        return [("content_block_start", {"type": "content_block_start", "index": len(self.content) - 1,
                                         "content_block": dict(block)})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}
