"""`ringserve proxy`: the OpenAI endpoint in front of prefill and decode servers (vLLM's two legs).

A completion or chat request is sent
  1. to a prefill server, as given but with `max_tokens` 1, `stream` false and
     `kv_transfer_params: {"do_remote_decode": true}`; it answers with the params of where it
     holds the prompt's KV (and the first token it sampled);
  2. to a decode server, as the client sent it plus those params (and, for a prompt with images,
     the prefill's `prefilled_images`: each image's grid and digest, which the decode server
     checks its own images against); its answer (streamed or not) goes back to the client byte
     for byte.
That is vLLM's toy-proxy protocol, so either side also works behind vLLM's proxy, and this
proxy in front of servers that speak it. Each leg picks the live server with the least token
load (what this proxy has in flight there: prompt tokens for a prefill, prompt + expected
output tokens for a decode). A server that refuses connections, or fails its /health poll, is
out of rotation until a poll succeeds; with no prefill or no decode server up the proxy
answers 503 and says which. A decode leg that cannot connect is retried on another decode
server (the params are not bound to one); so is a prefill leg that cannot connect, or whose
server died before answering. A server that took a leg and then died or stayed silent past
--request-timeout is answered with a JSON error that names it (502, or 504 for silence); one
that dies mid-stream ends the stream with an error event and `data: [DONE]`.

/v1/models, /tokenize and /detokenize are passed to a live decode server (every server behind
the proxy serves the same weights and tokenizer), so clients that count tokens (`ringserve
bench`) see the same prompts through the proxy as against one server.

Each response carries `x-pd-prefill-ms` (leg 1's round trip) so that a client can split its
time to first token into prefill and the rest (transfer + first decode step).
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import signal
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from . import systemd
from .systemd import WatchdogFeeder

logger = logging.getLogger(__name__)
_HEALTH_EVERY_S = 1.0
_HOP_HEADERS = {"authorization", "content-length", "host", "connection", "transfer-encoding", "content-type",
                "accept-encoding"}


# ---- routing -----------------------------------------------------------------------------------
@dataclass
class Backend:
    url: str
    alive: bool = True
    why_down: str = ""
    owed: dict[int, int] = field(default_factory=dict)  # proxy request id → tokens it costs here

    @property
    def load(self) -> int:
        return sum(self.owed.values())


class Pool:
    """Servers of one role, picked by token load (ties: the first listed)."""

    def __init__(self, role: str, urls: list[str]):
        if not urls:
            raise ValueError(f"give at least one --{role} URL")
        self.role = role
        self.backends = [Backend(u.rstrip("/")) for u in urls]

    def pick(self, exclude: tuple[Backend, ...] = ()) -> Backend | None:
        live = [b for b in self.backends if b.alive and b not in exclude]
        return min(live, key=lambda b: b.load) if live else None

    def down_reason(self) -> str:
        return "; ".join(f"{b.url}: {b.why_down or 'down'}" for b in self.backends)


IMAGE_TOKENS_ESTIMATE = 1024  # an image's span at most (DeepSeek-V4.1's default token budget)


def estimate_prompt_tokens(body: dict) -> int:
    """Tokens a prompt will take, before any server tokenized it (≈ 4 characters a token; an
    image part counts as a full image span, not as the characters of its URL or base64 data)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
    images = 0
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            parts = [p for p in content if isinstance(p, dict)]
            is_image = [p.get("type") in ("image_url", "input_image", "image") for p in parts]
            images += sum(is_image)
            content = [p for p, image in zip(parts, is_image) if not image]
        texts.append(content if isinstance(content, str) else json.dumps(content))
    return 1 + sum(len(t) for t in texts if isinstance(t, str)) // 4 + images * IMAGE_TOKENS_ESTIMATE


# ---- the proxy ---------------------------------------------------------------------------------
class Unavailable(Exception):
    pass


# A server that could not be reached at all: it saw nothing of the request, so another may take it.
_CANNOT_CONNECT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


def _broke_off(role: str, b: "Backend", exc: BaseException, timeout_s: float) -> web.Response:
    """The answer when a server took the request and then failed to answer it: it closed the
    connection (it died) → 502, or stayed silent past --request-timeout → 504. Always a JSON
    error body that names the server and the cause."""
    if isinstance(exc, asyncio.TimeoutError):
        return _error(504, f"{role} server {b.url} sent nothing for {timeout_s:g} s", "server_error",
                      code=f"{role}_timeout")
    return _error(502, f"{role} server {b.url} stopped before answering: {type(exc).__name__}", "server_error",
                  code=f"{role}_failed")


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], api_key: str | None = None,
                 backend_api_key: str | None = None, request_timeout_s: float = 600.0):
        self.prefill, self.decode = Pool("prefill", prefill), Pool("decode", decode)
        self.api_key, self.backend_api_key = api_key, backend_api_key
        self.request_timeout_s = request_timeout_s
        self.session: aiohttp.ClientSession | None = None
        self._next_id = 0
        self._health_task: asyncio.Task | None = None
        self.draining = False
        self.in_flight = 0

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=self.request_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        await self.poll_health()
        self._health_task = asyncio.ensure_future(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    # ---- health ---------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(_HEALTH_EVERY_S)
            await self.poll_health()

    async def poll_health(self) -> None:
        backends = self.prefill.backends + self.decode.backends
        await asyncio.gather(*(self._check(b) for b in backends))

    async def _check(self, b: Backend) -> None:
        try:
            async with self.session.get(b.url + "/health", timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                ok, why = r.status == 200, f"/health answered {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            ok, why = False, f"unreachable ({type(exc).__name__})"
        if ok != b.alive:
            logger.warning("%s %s is %s", "prefill" if b in self.prefill.backends else "decode", b.url,
                           "up again" if ok else f"down: {why}")
        b.alive, b.why_down = ok, "" if ok else why

    def _mark_down(self, b: Backend, exc: BaseException) -> None:
        b.alive, b.why_down = False, f"refused a connection ({type(exc).__name__}: {exc})"
        logger.warning("%s is down: %s", b.url, b.why_down)

    # ---- requests -------------------------------------------------------------------------
    def headers(self, request: web.Request) -> dict[str, str]:
        out = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        auth = f"Bearer {self.backend_api_key}" if self.backend_api_key else request.headers.get("Authorization")
        if auth:
            out["Authorization"] = auth
        return out

    def _unavailable(self) -> str | None:
        if self.prefill.pick() is None:
            return f"no prefill server is up ({self.prefill.down_reason()})"
        if self.decode.pick() is None:
            return f"no decode server is up ({self.decode.down_reason()})"
        return None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        if "kv_transfer_params" in body:
            return _error(400, "'kv_transfer_params' is set by the proxy, not by clients", "invalid_request_error",
                          "kv_transfer_params")
        why = self._unavailable()
        if why is not None:
            return _error(503, why, "service_unavailable", code="no_backend")
        self._next_id += 1
        rid, headers = self._next_id, self.headers(request)
        self.in_flight += 1
        try:
            started = time.perf_counter()
            first = await self._prefill(rid, request.path, body, headers)
            if isinstance(first, web.Response):
                return first
            prefill_ms = (time.perf_counter() - started) * 1e3
            leg2 = dict(body, kv_transfer_params=first["kv_transfer_params"])
            if first.get("prefilled_images") is not None:  # the decode leg checks it sees the same images
                leg2["prefilled_images"] = first["prefilled_images"]
            prompt = int(first.get("usage", {}).get("prompt_tokens", 0))
            return await self._decode(rid, request, leg2, headers, prompt, prefill_ms)
        except Unavailable as exc:
            return _error(503, str(exc), "service_unavailable", code="no_backend")
        finally:
            self.in_flight -= 1

    async def _prefill(self, rid: int, path: str, body: dict, headers: dict) -> dict | web.Response:
        leg1 = {k: v for k, v in body.items() if k != "stream_options"}
        leg1.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in leg1:
            leg1["max_completion_tokens"] = 1
        tried: tuple[Backend, ...] = ()
        while (b := self.prefill.pick(tried)) is not None:
            tried += (b,)
            b.owed[rid] = estimate_prompt_tokens(body)
            try:
                async with self.session.post(b.url + path, json=leg1, headers=headers) as r:
                    data = await r.read()
                    if r.status != 200:
                        return web.Response(body=data, status=r.status, content_type="application/json")
                    first = json.loads(data)
            except _CANNOT_CONNECT as exc:
                self._mark_down(b, exc)
                continue
            except aiohttp.ClientError as exc:  # it took the request, then closed or went silent
                if isinstance(exc, asyncio.TimeoutError) or self.prefill.pick(tried) is None:
                    return _broke_off("prefill", b, exc, self.request_timeout_s)
                # it died computing the prompt (its lease, if any, dies with it): another one may
                logger.warning("prefill %s failed mid-request (%s); trying another", b.url, type(exc).__name__)
                continue
            except ValueError:
                return _error(502, f"prefill server {b.url} answered with invalid JSON", "server_error",
                              code="bad_prefill")
            finally:
                b.owed.pop(rid, None)
            if not isinstance(first, dict) or not isinstance(first.get("kv_transfer_params"), dict):
                return _error(502, f"prefill server {b.url} returned no kv_transfer_params (is it started with "
                                   "--kv-role prefill --kv-transfer nixl?)", "server_error", code="bad_prefill")
            return first
        raise Unavailable(f"no prefill server is up ({self.prefill.down_reason()})")

    async def _decode(self, rid: int, request: web.Request, leg2: dict, headers: dict, prompt: int,
                      prefill_ms: float) -> web.StreamResponse:
        expected = prompt + int(leg2.get("max_tokens") or leg2.get("max_completion_tokens") or 16)
        tried: tuple[Backend, ...] = ()
        while (b := self.decode.pick(tried)) is not None:
            tried += (b,)
            b.owed[rid] = expected
            try:
                return await self._relay(b, request, leg2, headers, prefill_ms)
            except _CANNOT_CONNECT as exc:
                self._mark_down(b, exc)
            except aiohttp.ClientError as exc:  # before any byte of its answer reached the client
                return _broke_off("decode", b, exc, self.request_timeout_s)
            finally:
                b.owed.pop(rid, None)
        raise Unavailable(f"no decode server is up ({self.decode.down_reason()})")

    async def _relay(self, b: Backend, request: web.Request, leg2: dict, headers: dict,
                     prefill_ms: float) -> web.StreamResponse:
        """Send leg 2 and pass its answer through (SSE chunk by chunk as it arrives). A failure
        before the answer started raises (the caller answers with a JSON error); one mid-stream
        ends the stream with an error event and [DONE]."""
        extra = {"x-pd-prefill-ms": f"{prefill_ms:.2f}", "x-pd-decode-server": b.url}
        async with self.session.post(b.url + request.path, json=leg2, headers=headers) as r:
            kind = r.headers.get("Content-Type", "application/json")
            if not kind.startswith("text/event-stream"):
                data = await r.read()
                return web.Response(body=data, status=r.status, headers={"Content-Type": kind, **extra})
            out = web.StreamResponse(status=r.status, headers={"Content-Type": kind, "Cache-Control": "no-cache",
                                                               "X-Accel-Buffering": "no", **extra})
            await out.prepare(request)
            try:
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
            except aiohttp.ClientError as exc:  # the decode server went away mid-stream: say so, then end
                err = {"error": {"message": f"decode server {b.url} stopped mid-response: {type(exc).__name__}",
                                 "type": "server_error", "param": None, "code": "decode_failed"}}
                await out.write(b"data: " + json.dumps(err).encode() + b"\n\n" + b"data: [DONE]\n\n")
            await out.write_eof()
            return out

    async def forward(self, request: web.Request) -> web.Response:
        """Routes any server answers alike (/v1/models, /tokenize, /detokenize: same weights and
        tokenizer behind every URL): the first live decode server's answer, passed through."""
        b = self.decode.pick()
        if b is None:
            return _error(503, f"no decode server is up ({self.decode.down_reason()})", "service_unavailable")
        data = await request.read() if request.method == "POST" else None
        headers = self.headers(request)
        if data is not None:
            headers["Content-Type"] = request.headers.get("Content-Type", "application/json")
        try:
            async with self.session.request(request.method, b.url + request.path, data=data, headers=headers) as r:
                return web.Response(body=await r.read(), status=r.status,
                                    content_type=r.headers.get("Content-Type", "application/json").split(";")[0])
        except _CANNOT_CONNECT as exc:
            self._mark_down(b, exc)
            return _error(503, f"decode server {b.url} is down", "service_unavailable")
        except aiohttp.ClientError as exc:
            return _broke_off("decode", b, exc, self.request_timeout_s)


# ---- the app -----------------------------------------------------------------------------------
def _error(status: int, message: str, err_type: str, param: str | None = None, code: str | None = None):
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return web.json_response(body, status=status, headers={"Retry-After": "1"} if status in (429, 503) else None)


async def _json_body(request: web.Request) -> dict:
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        raise web.HTTPBadRequest(text=json.dumps({"error": {"message": "the request body is not valid JSON",
                                                             "type": "invalid_request_error", "param": None,
                                                             "code": "invalid_json"}}),
                                 content_type="application/json") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=json.dumps({"error": {"message": "the request body must be a JSON object",
                                                             "type": "invalid_request_error", "param": None,
                                                             "code": "invalid_body"}}),
                                 content_type="application/json")
    return body


PROXY = web.AppKey("ringserve_proxy", Proxy)


def make_proxy_app(proxy: Proxy, max_body_bytes: int = 4 << 20) -> web.Application:
    @web.middleware
    async def auth(request: web.Request, handler):
        if proxy.api_key is None or request.path in ("/health", "/ready"):
            return await handler(request)
        given = request.headers.get("Authorization", "")
        token = given[7:] if given.startswith("Bearer ") else ""
        if not hmac.compare_digest(token.encode(), proxy.api_key.encode()):
            return _error(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
        return await handler(request)

    async def generate(request: web.Request) -> web.StreamResponse:
        if proxy.draining:
            return _error(503, "the proxy is shutting down", "service_unavailable", code="draining")
        return await proxy.generate(request)

    async def health(request: web.Request) -> web.Response:
        why = proxy._unavailable()
        return web.json_response({"status": "ok" if why is None else why}, status=200 if why is None else 503)

    async def ready(request: web.Request) -> web.Response:
        why = "draining" if proxy.draining else proxy._unavailable()
        return web.json_response({"status": "ready" if why is None else why}, status=200 if why is None else 503)

    app = web.Application(middlewares=[auth], client_max_size=max_body_bytes)
    app[PROXY] = proxy
    app.add_routes([web.post("/v1/completions", generate), web.post("/v1/chat/completions", generate),
                    web.get("/v1/models", proxy.forward), web.post("/tokenize", proxy.forward),
                    web.post("/detokenize", proxy.forward), web.get("/health", health), web.get("/ready", ready)])
    return app


# ---- command line ------------------------------------------------------------------------------
def add_proxy_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("proxy", help="OpenAI endpoint in front of prefill and decode servers (PD disaggregation)")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers (--kv-role prefill)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers (--kv-role decode)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' from clients")
    p.add_argument("--backend-api-key", default=None,
                   help="key for the servers behind (default: forward the client's Authorization header)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a server may stay silent")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    p.set_defaults(func=cmd_proxy)


def cmd_proxy(args: argparse.Namespace) -> int:
    from ipc.loop import new_event_loop

    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(serve_proxy(args))
    finally:
        loop.close()


async def serve_proxy(args: argparse.Namespace) -> int:
    proxy = Proxy(args.prefill, args.decode, args.api_key, args.backend_api_key, args.request_timeout)
    await proxy.start()
    runner = web.AppRunner(make_proxy_app(proxy), access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
    except OSError as exc:
        await proxy.close()
        raise OSError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    feeder = WatchdogFeeder(lambda: True)  # the loop itself answering is the proxy's health
    feeder.start()
    systemd.notify_ready(f"proxy: {len(args.prefill)} prefill, {len(args.decode)} decode server(s)")
    print(f"ringserve proxy on http://{args.host}:{args.port}: prefill {' '.join(args.prefill)}; "
          f"decode {' '.join(args.decode)}", flush=True)
    await stop.wait()
    proxy.draining = True
    systemd.notify_stopping("draining")
    deadline = time.monotonic() + args.drain_timeout
    while proxy.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await feeder.stop()
    await runner.cleanup()
    await proxy.close()
    return 0
