"""The HTTP connection layer under the app: aiohttp's, with the guards a public endpoint needs.

  * Errors aiohttp raises before any handler runs (a malformed request line, a smuggling
    attempt, an oversized header or too many of them) answer with the OpenAI JSON error body,
    like every other error, and are logged in one line, not as a traceback.
  * The server holds at most `max_connections` connections at once; one more is answered 503
    (JSON, `Retry-After`) and closed, so idle or slow clients cannot exhaust it.
  * A request's head must arrive within `header_timeout_s` of the connection opening or of the
    previous response, else the connection is closed (aiohttp's keep-alive timer closes a
    connection whose handler is still waiting for a request, however slowly bytes trickle in);
    its body must arrive within `body_timeout_s` (see handlers.read_json).

aiohttp builds its low-level `Server` inside `AppRunner`; `Runner` swaps in `GuardedServer`,
which makes `GuardedHandler`s. tests/e2e/test_bad_input.py pins the behaviour.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web, web_protocol

logger = logging.getLogger(__name__)


def error_json(status: int, message: str, err_type: str, code: str | None = None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": err_type, "param": param, "code": code}}).encode()


def _error_type(status: int) -> str:
    return {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
            503: "service_unavailable"}.get(status, "invalid_request_error" if status < 500 else "server_error")


class GuardedHandler(web_protocol.RequestHandler):
    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:  # a bug escaped the app's own error middleware: log it in full
            self.log_exception("error handling request from %s", request.remote, exc_info=exc)
            text = "internal server error"
        else:  # the client's malformed HTTP: one line
            text = " ".join((message or getattr(exc, "message", "") or "bad request").split())
            logger.info("HTTP %d from %s: %s", status, request.remote, text)
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error response")
        resp = web.Response(status=status, body=error_json(status, text, _error_type(status), code=str(status)),
                            content_type="application/json")
        resp.force_close()
        return resp


class GuardedServer(web.Server):
    def __init__(self, *args, max_connections: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_connections = max_connections
        self.rejected_connections = 0

    def __call__(self) -> GuardedHandler:
        return GuardedHandler(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler, transport) -> None:
        super().connection_made(handler, transport)
        if len(self._connections) > self.max_connections:
            self.rejected_connections += 1
            body = error_json(503, f"too many connections (the limit is {self.max_connections}); retry later",
                              "service_unavailable", code="too_many_connections")
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                            b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            transport.close()


class Runner(web.AppRunner):
    """AppRunner whose server is a GuardedServer (same app, same handler arguments)."""

    def __init__(self, app: web.Application, *, max_connections: int, **kwargs):
        super().__init__(app, **kwargs)
        self._max_connections = max_connections

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return GuardedServer(plain.request_handler, request_factory=plain.request_factory,
                             handler_cancellation=plain.handler_cancellation, loop=plain._loop,
                             max_connections=self._max_connections, **plain._kwargs)
