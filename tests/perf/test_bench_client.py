"""The streaming client against an in-process fake server: chunk token counts, usage, errors,
the client-side concurrency limit and the queue time it causes."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from perf.serving import client, metrics, runner
from perf.serving.records import RequestRecord, RequestSpec

SEEN: list[dict] = []


def _chunk(content: str | None, completion: int | None = None, choices: bool = True) -> bytes:
    d: dict = {"object": "chat.completion.chunk", "choices": []}
    if choices:
        d["choices"] = [{"index": 0, "delta": {} if content is None else {"content": content}, "finish_reason": None}]
    if completion is not None:
        d["usage"] = {"prompt_tokens": 7, "completion_tokens": completion}
    return b"data: " + json.dumps(d).encode() + b"\n\n"


async def _stream(request: web.Request, parts: list[bytes], delay: float = 0.0) -> web.StreamResponse:
    SEEN.append(await request.json())
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for part in parts:
        await asyncio.sleep(delay)
        await resp.write(part)
    return resp


async def exact(request: web.Request) -> web.StreamResponse:
    # per-chunk usage: a role chunk, then 1, 2 and 3 tokens (speculation), finish, final usage
    return await _stream(request, [_chunk(None, 0), _chunk("a", 1), _chunk("bc", 3), _chunk("", 6),
                                   _chunk(None, 6), _chunk(None, 6, choices=False), b"data: [DONE]\n\n"])


async def inexact(request: web.Request) -> web.StreamResponse:
    return await _stream(request, [_chunk("a"), _chunk("b"), _chunk("c"), _chunk(None, 7, choices=False),
                                   b"data: [DONE]\n\n"])


async def final_on_finish(request: web.Request) -> web.StreamResponse:
    # usage only on the finish chunk (which has choices but no text): not a 5-token chunk
    finish = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
              "usage": {"prompt_tokens": 7, "completion_tokens": 5}}
    return await _stream(request, [_chunk("a"), _chunk("b"), b"data: " + json.dumps(finish).encode() + b"\n\n",
                                   b"data: [DONE]\n\n"])


async def slow(request: web.Request) -> web.StreamResponse:
    return await _stream(request, [_chunk("a"), _chunk("b"), _chunk(None, 2, choices=False), b"data: [DONE]\n\n"],
                         delay=0.05)


async def fail(request: web.Request) -> web.Response:
    return web.json_response({"error": "boom"}, status=500)


async def empty(request: web.Request) -> web.StreamResponse:
    return await _stream(request, [b": keep-alive\n\n"])


def _app() -> web.Application:
    app = web.Application()
    for name, h in (("exact", exact), ("inexact", inexact), ("final", final_on_finish), ("slow", slow), ("fail", fail), ("empty", empty)):
        app.router.add_post(f"/{name}/v1/chat/completions", h)
    return app


async def _one(base: str, path: str) -> RequestRecord:
    api = client.ApiConfig(base_url=f"{base}/{path}", model="m")
    async with aiohttp.ClientSession() as http:
        return await client.send(http, api, RequestRecord(RequestSpec("hello", 6, 5)))


def _with_server(fn):
    async def main():
        server = TestServer(_app())
        await server.start_server()
        try:
            return await fn(str(server.make_url("")).rstrip("/"))
        finally:
            await server.close()
    return asyncio.run(main())


def test_per_chunk_usage_gives_exact_multi_token_chunks():
    r = _with_server(lambda base: _one(base, "exact"))
    assert r.ok and r.chunk_tokens == [1, 2, 3] and r.chunk_tokens_exact
    assert (r.prompt_tokens, r.completion_tokens, r.output_tokens) == (7, 6, 6)
    assert r.first_token_s == r.chunk_times[0] and r.ttft_s > 0
    body = SEEN[-1]
    assert body["ignore_eos"] is True and body["stream"] is True and body["max_tokens"] == 6
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["messages"] == [{"role": "user", "content": "hello"}]
    assert len(metrics.record_itl_s(r)) == 5


def test_without_per_chunk_counts_usage_total_is_apportioned():
    r = _with_server(lambda base: _one(base, "inexact"))
    assert r.ok and r.chunk_tokens == [1, 1, 1] and not r.chunk_tokens_exact
    assert r.output_tokens == 7
    assert metrics.apportion(r.chunk_tokens, r.completion_tokens, r.chunk_tokens_exact) == [1, 3, 3]


def test_usage_on_the_finish_chunk_is_a_total_not_a_chunk():
    r = _with_server(lambda base: _one(base, "final"))
    assert r.ok and r.chunk_tokens == [1, 1] and not r.chunk_tokens_exact and r.output_tokens == 5


def test_http_error_and_empty_stream_are_failures():
    bad = _with_server(lambda base: _one(base, "fail"))
    assert not bad.ok and bad.error.startswith("HTTP 500")
    empty_rec = _with_server(lambda base: _one(base, "empty"))
    assert not empty_rec.ok and "without data" in empty_rec.error


def test_concurrency_limit_moves_waiting_out_of_ttft():
    async def go(base: str):
        cfg = runner.RunConfig(api=client.ApiConfig(base_url=f"{base}/slow", model="m"), max_concurrency=1,
                               show_progress=False)
        return await runner.run_open_loop(cfg, [RequestSpec("x", 2, 1) for _ in range(3)])

    res = _with_server(go)
    m = metrics.compute(res.records, res.end_s - res.start_s, res.start_s)
    assert m["completed"] == 3 and m["peak_concurrent_requests"] == 1
    # each request streams ~0.15 s; the last waits for two others: queue ≈ 0.3 s, TTFT stays ≈ 0.05 s
    assert m["queue_ms"]["p99"] > 200
    assert m["ttft_ms"]["p99"] < m["queue_ms"]["p99"] / 2
    assert m["ttft_from_ready_ms"]["mean"] == pytest.approx(m["queue_ms"]["mean"] + m["ttft_ms"]["mean"])
    assert res.metrics_before is None  # no /metrics here → server block is n/a
