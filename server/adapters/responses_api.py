"""OpenAI's Responses API: `POST /v1/responses` (whole or streamed), stateless, on the chat path
(request: responses_request.py).

The output items are built from the chat output's events: a `reasoning` item (its text as one
`reasoning_text` content part, as vLLM returns it), a `message` item with one `output_text` part,
one `function_call` item per tool call, a new item whenever the kind changes. Streamed:
`response.created`, `response.in_progress`, then per item `response.output_item.added`,
`response.content_part.added`, `response.reasoning_text.delta` / `response.output_text.delta` /
`response.function_call_arguments.delta`, their `.done`, `response.content_part.done`,
`response.output_item.done`; last `response.completed` — or, when the output was cut by
`max_output_tokens` (or the server's deadline), `response.incomplete` with `incomplete_details`, as
OpenAI ends such a response. Whole: the same items. A failure after the 200 is an `error` event
and `response.failed`.

Usage: `input_tokens` (the whole prompt) with `input_tokens_details.cached_tokens` (the
prefix-cache hit), `output_tokens` with `output_tokens_details.reasoning_tokens`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from aiohttp import web

from ..chat import ContentDelta, OutputEvent, ReasoningDelta, ToolCallArgumentsDelta, ToolCallStart
from ..errors import ProtocolError
from ..handlers import read_json
from ..state import STATE
from .common import ChatRun, new_id, stream_events
from .responses_request import translate


async def responses(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    run = await ChatRun.prepare(request, translate(body, state.renderer.version))
    with state.admit(1):  # raises 429/503 when overloaded or draining
        run.start()
        reply = _Reply(run, body)
        if run.req.stream:
            return await stream_events(request, reply.stream(), reply.error_events)
        return web.json_response(await reply.whole())


class _Reply:
    def __init__(self, run: ChatRun, body: dict):
        self.run, self.body = run, body
        self.id = new_id("resp_")
        self.created = int(time.time())
        self.items = _Items()
        self.sequence = 0

    async def whole(self) -> dict:
        async with aclosing(self.run.events()) as events:
            async for event in events:
                self.items.feed(event)
        status, incomplete = self._status()
        self.items.close(status == "completed")
        return self._response(status, self.items.output, self._usage(), incomplete=incomplete)

    async def stream(self) -> AsyncIterator[tuple[str, dict]]:
        yield self._event("response.created", response=self._response("in_progress", []))
        yield self._event("response.in_progress", response=self._response("in_progress", []))
        async with aclosing(self.run.events()) as events:
            async for event in events:
                for name, data in self.items.feed(event):
                    yield self._event(name, **data)
        status, incomplete = self._status()
        for name, data in self.items.close(status == "completed"):
            yield self._event(name, **data)
        final = self._response(status, self.items.output, self._usage(), incomplete=incomplete)
        yield self._event(f"response.{status}", response=final)

    def error_events(self, exc: ProtocolError) -> list[tuple[str, dict]]:
        error = {"code": "server_error" if exc.status >= 500 else exc.code, "message": exc.message}
        return [self._event("error", code=exc.code, message=exc.message, param=exc.param),
                self._event("response.failed", response=self._response("failed", self.items.output, error=error))]

    def _event(self, kind: str, /, **fields) -> tuple[str, dict]:
        self.sequence += 1
        return kind, {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _status(self) -> tuple[str, dict | None]:
        reason = self.run.finish_reason
        if reason == "length":
            return "incomplete", {"reason": "max_output_tokens"}
        if reason == "abort":  # the server's request deadline
            return "incomplete", {"reason": None}
        return "completed", None

    def _usage(self) -> dict:
        run = self.run
        return {"input_tokens": run.prompt_tokens, "input_tokens_details": {"cached_tokens": run.cached_tokens},
                "output_tokens": run.output_tokens, "output_tokens_details": {"reasoning_tokens": run.reasoning_tokens},
                "total_tokens": run.prompt_tokens + run.output_tokens}

    def _response(self, status: str, output: list[dict], usage: dict | None = None, error: dict | None = None,
                  incomplete: dict | None = None) -> dict:
        body, req = self.body, self.run.req
        text_format = (body.get("text") or {}).get("format") or {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": incomplete, "instructions": body.get("instructions"),
                "max_output_tokens": body.get("max_output_tokens"), "model": req.model, "output": list(output),
                "parallel_tool_calls": req.chat.parallel_tool_calls, "previous_response_id": None,
                "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
                "store": False, "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
                "text": {"format": text_format}, "tool_choice": body.get("tool_choice") or "auto",
                "tools": body.get("tools") or [], "truncation": "disabled", "usage": usage,
                "user": body.get("user"), "metadata": body.get("metadata") or {}}


class _Items:
    """Output events → Responses output items. `feed` and `close` return the stream's events
    (name, fields); `output` accumulates the same items for the whole response."""

    def __init__(self):
        self.output: list[dict] = []
        self._open: str | None = None  # the type of output[-1] while it is open
        self._text = ""  # the open item's reasoning text, output text or arguments

    def feed(self, event: OutputEvent) -> list[tuple[str, dict]]:
        if isinstance(event, ReasoningDelta):
            return self._add_text("reasoning", event.text)
        if isinstance(event, ContentDelta):
            return self._add_text("message", event.text)
        if isinstance(event, ToolCallStart):
            call = {"type": "function_call", "id": new_id("fc_"), "call_id": event.id, "name": event.name,
                    "arguments": "", "status": "in_progress"}
            return self.close(True) + self._start(call)
        if isinstance(event, ToolCallArgumentsDelta):
            self._text += event.arguments
            return [("response.function_call_arguments.delta", {**self._where(), "delta": event.arguments})]
        return []

    def close(self, complete: bool) -> list[tuple[str, dict]]:
        """End the open item: `complete` unless the output was cut inside it (a function call
        is only ever emitted whole)."""
        if self._open is None:
            return []
        item, where, text = self.output[-1], self._where(), self._text
        if self._open == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out = [("response.reasoning_text.done", {**where, "content_index": 0, "text": text}),
                   ("response.content_part.done", {**where, "content_index": 0, "part": part})]
            item["content"] = [part]
        elif self._open == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out = [("response.output_text.done", {**where, "content_index": 0, "text": text, "logprobs": []}),
                   ("response.content_part.done", {**where, "content_index": 0, "part": part})]
            item["content"] = [part]
        else:
            item["arguments"] = text
            out = [("response.function_call_arguments.done", {**where, "name": item["name"], "arguments": text})]
            complete = True
        item["status"] = "completed" if complete else "incomplete"
        self._open, self._text = None, ""
        return out + [("response.output_item.done", {"output_index": where["output_index"], "item": dict(item)})]

    def _add_text(self, kind: str, text: str) -> list[tuple[str, dict]]:
        if not text:
            return []
        out = []
        if self._open != kind:
            if kind == "reasoning":
                item = {"type": "reasoning", "id": new_id("rs_"), "summary": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"type": "message", "id": new_id("msg_"), "role": "assistant", "status": "in_progress",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out = self.close(True) + self._start(item)
            out.append(("response.content_part.added", {**self._where(), "content_index": 0, "part": part}))
        self._text += text
        if kind == "reasoning":
            return out + [("response.reasoning_text.delta", {**self._where(), "content_index": 0, "delta": text})]
        return out + [("response.output_text.delta", {**self._where(), "content_index": 0, "delta": text,
                                                      "logprobs": []})]

    def _start(self, item: dict) -> list[tuple[str, dict]]:
        self.output.append(item)
        self._open = item["type"]
        return [("response.output_item.added", {"output_index": len(self.output) - 1, "item": dict(item)})]

    def _where(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}
