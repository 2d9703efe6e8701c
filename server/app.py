"""The aiohttp application: one routes table, auth and error middlewares, small endpoints.

Every failure is a JSON error body with a 4xx status for the client's mistakes, in the API's own
shape: Anthropic's (`{"type": "error", "error": {type, message}}`) on /v1/messages routes,
OpenAI's (`{"error": {message, type, param, code}}`) everywhere else; nothing ever returns a stack
trace. With an API key, every route except /health and /ready requires it, given as
`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's), compared in
constant time.
"""

from __future__ import annotations

import hmac
import json
import logging

from aiohttp import web

from . import handlers, offload
from .adapters import anthropic_api, responses_api
from .chat_request import parse_chat_request
from .openapi import openapi_spec
from .protocol import ProtocolError
from .state import STATE, AppState

logger = logging.getLogger(__name__)
PUBLIC = frozenset({"/health", "/ready"})


def _error(request: web.Request, exc: ProtocolError, headers: dict | None = None) -> web.Response:
    """The error response in the shape of the route's API."""
    if anthropic_api.is_anthropic_route(request.path):
        body = anthropic_api.error_body(exc.status, exc.message)
    else:
        body = exc.body()
    return web.json_response(body, status=exc.status, headers=headers)


@web.middleware
async def errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ProtocolError as exc:
        return _error(request, exc, {"Retry-After": "1"} if exc.status in (429, 503) else None)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error"}.get(exc.status, "invalid_request_error")
        return _error(request, ProtocolError(exc.reason, None, str(exc.status), exc.status, kind))
    except (ConnectionResetError, ConnectionError):
        raise
    except Exception:  # a bug: log it, never leak it
        logger.exception("internal error on %s %s", request.method, request.path)
        return _error(request, ProtocolError("internal server error", None, "internal_error", 500, "server_error"))


@web.middleware
async def auth(request: web.Request, handler):
    key = request.app[STATE].api_key
    if key is None or request.path in PUBLIC:
        return await handler(request)
    given = request.headers.get("Authorization", "")
    token = given[7:] if given.startswith("Bearer ") else request.headers.get("x-api-key", "")
    if not hmac.compare_digest(token.encode(), key.encode()):
        return _error(request, ProtocolError("invalid or missing API key", None, "invalid_api_key", 401,
                                             "authentication_error"))
    return await handler(request)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = [{"id": name, "object": "model", "created": int(state.started_at), "owned_by": "ringserve",
             "max_model_len": state.max_model_len} for name in state.served_names]
    return web.json_response({"object": "list", "data": data})


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await handlers.read_json(request)
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object", None, "invalid_body")
    # Large inputs tokenize, and their answer is written, off the event loop (server/offload.py).
    if isinstance(body.get("prompt"), str):
        answer = await offload.tokenize_body(state.tokenizer, text=body["prompt"],
                                             add_bos=bool(body.get("add_special_tokens", True)),
                                             max_model_len=state.max_model_len)
    elif isinstance(body.get("messages"), list):  # the ids a chat request with these fields would have
        chat = parse_chat_request(body)
        ids = await handlers.chat_prompt_ids(state, chat)
        if ids is not None:  # images: their spans expanded
            return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len})
        rendered = await offload.run(state.renderer.render, chat)
        answer = await offload.tokenize_body(state.tokenizer, text=rendered.text, add_bos=False,
                                             max_model_len=state.max_model_len)
    else:
        raise ProtocolError("give 'prompt' (a string) or 'messages'", "prompt", "invalid_value")
    return web.Response(body=answer, content_type="application/json")


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await handlers.read_json(request)
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < state.vocab_size
                                               for t in tokens):
        raise ProtocolError(f"'tokens' must be a list of token ids in [0, {state.vocab_size})", "tokens",
                            "invalid_value")
    return web.json_response({"prompt": await offload.decode(state.tokenizer, tokens)})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": request.app[STATE].version})


async def health(request: web.Request) -> web.Response:
    """Liveness: the workers are alive, not just this HTTP loop."""
    ok = request.app[STATE].client.healthy
    return web.json_response({"status": "ok" if ok else "worker dead"}, status=200 if ok else 503)


async def ready(request: web.Request) -> web.Response:
    """Readiness: models loaded and not draining."""
    state = request.app[STATE]
    ok = state.ready and not state.draining and state.client.healthy
    status = "ready" if ok else ("draining" if state.draining else "not ready")
    return web.json_response({"status": status}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.metrics is None:
        return web.Response(text="", content_type="text/plain")
    body, content_type = state.metrics.render()
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = content_type
    return resp


async def openapi(request: web.Request) -> web.Response:
    return web.Response(text=json.dumps(openapi_spec(request.app[STATE])), content_type="application/json")


def make_app(state: AppState) -> web.Application:
    app = web.Application(middlewares=[errors, auth], client_max_size=state.limits.max_body_bytes)
    app[STATE] = state
    app.add_routes([
        web.get("/v1/models", models),
        web.post("/v1/completions", handlers.completions),
        web.post("/v1/chat/completions", handlers.chat_completions),
        web.post("/v1/messages", anthropic_api.messages),
        web.post("/v1/messages/count_tokens", anthropic_api.count_tokens),
        web.post("/v1/responses", responses_api.responses),
        web.post("/tokenize", tokenize),
        web.post("/detokenize", detokenize),
        web.get("/version", version),
        web.get("/health", health),
        web.get("/ready", ready),
        web.get("/metrics", metrics),
        web.get("/openapi.json", openapi),
    ])
    return app
