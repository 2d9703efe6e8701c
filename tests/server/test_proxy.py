"""`ringserve proxy` against stub prefill/decode servers in this process (no engine, no NIXL):
the two legs it sends, token-load routing, failover, and the 503s that say which side is down."""
from __future__ import annotations

import asyncio
import socket

import aiohttp
from aiohttp import web

from server.proxy import Pool, Proxy, estimate_prompt_tokens, make_proxy_app


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stub:
    """A server of one role that records the bodies it got; a prefill answers with params."""

    def __init__(self, role: str, delay_s: float = 0.0):
        self.role, self.delay_s, self.bodies = role, delay_s, []
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            self.bodies.append(body)
            await asyncio.sleep(self.delay_s)
            if self.role == "prefill":
                return web.json_response({"choices": [{"text": "x"}], "usage": {"prompt_tokens": 3},
                                          "kv_transfer_params": {"do_remote_prefill": True, "from": self.url}})
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                for part in (b"data: {\"a\": 1}\n\n", b"data: [DONE]\n\n"):
                    await resp.write(part)
                await resp.write_eof()
                return resp
            return web.json_response({"choices": [{"text": "decoded"}], "echo": body["kv_transfer_params"]})

        async def health(request: web.Request) -> web.Response:
            return web.json_response({})

        app = web.Application()
        app.add_routes([web.post("/v1/completions", generate), web.get("/health", health)])
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()


async def _with_proxy(prefill: list[str], decode: list[str], fn):
    proxy = Proxy(prefill, decode)
    await proxy.start()
    runner = web.AppRunner(make_proxy_app(proxy))
    await runner.setup()
    port = _port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as s:
            return await fn(s, f"http://127.0.0.1:{port}", proxy)
    finally:
        await runner.cleanup()
        await proxy.close()


def test_two_legs_and_streaming_pass_through():
    async def main():
        pre, dec = Stub("prefill"), Stub("decode")
        await pre.start()
        await dec.start()

        async def fn(s, url, proxy):
            body = {"model": "m", "prompt": "hello there", "max_tokens": 7, "stream_options": {"x": 1}}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200 and float(r.headers["x-pd-prefill-ms"]) >= 0
                got = await r.json()
            leg1, leg2 = pre.bodies[0], dec.bodies[0]
            assert leg1["max_tokens"] == 1 and leg1["stream"] is False and "stream_options" not in leg1
            assert leg1["kv_transfer_params"] == {"do_remote_decode": True}
            assert leg2["max_tokens"] == 7 and leg2["kv_transfer_params"]["from"] == pre.url
            assert got["echo"] == leg2["kv_transfer_params"]
            async with s.post(url + "/v1/completions", json={**body, "stream": True}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                assert await r.read() == b"data: {\"a\": 1}\n\ndata: [DONE]\n\n"
            async with s.post(url + "/v1/completions", json={**body, "kv_transfer_params": {}}) as r:
                assert r.status == 400  # clients never set where KV is

        await _with_proxy([pre.url], [dec.url], fn)
        await pre.runner.cleanup()
        await dec.runner.cleanup()

    asyncio.run(main())


def test_503_names_the_missing_side_and_a_dead_decode_fails_over():
    async def main():
        pre, dec = Stub("prefill"), Stub("decode")
        await pre.start()
        await dec.start()
        dead = f"http://127.0.0.1:{_port()}"

        async def fn(s, url, proxy):
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            async with s.post(url + "/v1/completions", json=body) as r:  # the dead decode is skipped
                assert r.status == 200 and r.headers["x-pd-decode-server"] == dec.url
            await dec.runner.cleanup()
            await proxy.poll_health()
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 503 and "no decode server is up" in (await r.json())["error"]["message"]
            await pre.runner.cleanup()
            await proxy.poll_health()
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 503 and "no prefill server is up" in (await r.json())["error"]["message"]
            async with s.get(url + "/ready") as r:
                assert r.status == 503

        await _with_proxy([pre.url], [dead, dec.url], fn)

    asyncio.run(main())


def test_picks_the_server_with_the_least_tokens_in_flight():
    pool = Pool("decode", ["http://a", "http://b", "http://c"])
    a, b, c = pool.backends
    a.owed, b.owed = {1: 500}, {2: 100, 3: 100}
    assert pool.pick() is c
    c.owed = {4: 300}
    assert pool.pick() is b and pool.pick(exclude=(b,)) is c
    b.alive = c.alive = False
    assert pool.pick() is a
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": "x" * 40}]}) == 11
    assert "http://b: down" in pool.down_reason()
