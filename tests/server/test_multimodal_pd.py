"""`ringserve proxy` with a chat request carrying images, against stub prefill/decode servers in
this process: the decode leg gets the prefill's `prefilled_images` (grids and digests, which it
checks its own images against) beside the request, and the token-load estimate counts an image
as an image span, not as its base64 text."""

from __future__ import annotations

import asyncio
import base64
import socket

import aiohttp
from aiohttp import web

from server.proxy import IMAGE_TOKENS_ESTIMATE, Proxy, estimate_prompt_tokens, make_proxy_app

PREFILLED = [{"grid": [4, 5], "digest": "ab" * 32}]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"\0" * 30000).decode()}}
BODY = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
    {"type": "text", "text": "what is it?"}, IMAGE]}]}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _serve(handler) -> tuple[web.AppRunner, str]:
    async def health(request):
        return web.json_response({})

    app = web.Application(client_max_size=1 << 22)
    app.add_routes([web.post("/v1/chat/completions", handler), web.get("/health", health)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = _port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def test_the_decode_leg_gets_the_prefills_image_grids():
    legs: list[dict] = []

    async def prefill(request):
        legs.append(await request.json())
        return web.json_response({"choices": [], "usage": {"prompt_tokens": 30},
                                  "kv_transfer_params": {"do_remote_prefill": True}, "prefilled_images": PREFILLED})

    async def decode(request):
        legs.append(await request.json())
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    async def main():
        p_runner, p_url = await _serve(prefill)
        d_runner, d_url = await _serve(decode)
        proxy = Proxy([p_url], [d_url])
        await proxy.start()
        runner = web.AppRunner(make_proxy_app(proxy))
        await runner.setup()
        port = _port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY) as r:
                    return r.status, await r.json()
        finally:
            await runner.cleanup()
            await proxy.close()
            await p_runner.cleanup()
            await d_runner.cleanup()

    status, answer = asyncio.run(main())
    assert status == 200 and answer["choices"][0]["message"]["content"] == "ok"
    leg1, leg2 = legs
    assert "prefilled_images" not in leg1 and leg1["kv_transfer_params"] == {"do_remote_decode": True}
    assert leg2["prefilled_images"] == PREFILLED and leg2["kv_transfer_params"] == {"do_remote_prefill": True}
    assert leg2["messages"] == BODY["messages"]  # the request as sent: the decode server loads them too


def test_an_image_counts_as_an_image_span_in_the_load_estimate():
    text_only = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}]}]}
    assert estimate_prompt_tokens(BODY) == estimate_prompt_tokens(text_only) + IMAGE_TOKENS_ESTIMATE
    assert estimate_prompt_tokens(BODY) < 10_000 / 4  # not the 40 000 base64 characters
