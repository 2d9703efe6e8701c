"""The client against an in-process stub that streams reasoning, content and tool-call deltas
(chunks shaped by the official `openai` client's ChatCompletionChunk model): reasoning counts as
output and starts TTFT, usage's cached and reasoning tokens are read; a session replayed in the
agentx shape sends growing histories with its session headers."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from perf.serving import agentx, client, conversation, metrics, runner, textgen
from perf.serving.records import RequestRecord, RequestSpec

openai_chat = pytest.importorskip("openai.types.chat")

SEEN: list[tuple[dict, dict]] = []  # (body, headers) of every request


def _chunk(delta: dict | None, finish: str | None = None, usage: dict | None = None) -> bytes:
    d = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
         "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        d["usage"] = usage
    chunk = openai_chat.ChatCompletionChunk.model_validate(d)  # the official shape (extra fields kept)
    return b"data: " + chunk.model_dump_json(exclude_unset=True).encode() + b"\n\n"


USAGE = {"prompt_tokens": 50, "completion_tokens": 6, "total_tokens": 56,
         "prompt_tokens_details": {"cached_tokens": 32}, "completion_tokens_details": {"reasoning_tokens": 3}}


async def reasoning_stream(request: web.Request) -> web.StreamResponse:
    SEEN.append((await request.json(), dict(request.headers)))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    parts = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning_content": "ab", "reasoning": "ab"}),  # both spellings of one delta: counted once
        _chunk({"reasoning": "c"}),  # vLLM's alias alone
        _chunk({"content": "d"}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                "function": {"name": "read", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"p\": 1}"}}]}),
        _chunk({}, finish="tool_calls"),
        _chunk(None, usage=USAGE),
        b"data: [DONE]\n\n",
    ]
    for part in parts:
        await resp.write(part)
    return resp


async def turn_usage(request: web.Request) -> web.StreamResponse:
    """Usage whose cached tokens grow with the turn (the number of assistant messages)."""
    body = await request.json()
    SEEN.append((body, dict(request.headers)))
    turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
    usage = {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102,
             "prompt_tokens_details": {"cached_tokens": 20 * turn}, "completion_tokens_details": {"reasoning_tokens": 1}}
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    parts = (_chunk({"reasoning_content": "x"}), _chunk({"content": "y"}, finish="length"), _chunk(None, usage=usage),
             b"data: [DONE]\n\n")
    for part in parts:
        await resp.write(part)
    return resp


def _with_server(fn):
    async def main():
        app = web.Application()
        app.router.add_post("/r/v1/chat/completions", reasoning_stream)
        app.router.add_post("/t/v1/chat/completions", turn_usage)
        server = TestServer(app)
        await server.start_server()
        try:
            return await fn(str(server.make_url("")).rstrip("/"))
        finally:
            await server.close()
    return asyncio.run(main())


def test_reasoning_and_tool_call_deltas_are_output_and_start_ttft():
    async def go(base: str) -> RequestRecord:
        api = client.ApiConfig(base_url=f"{base}/r", model="m", continuous_usage=False)
        async with aiohttp.ClientSession() as http:
            return await client.send(http, api, RequestRecord(RequestSpec("hi", 6, 5)))

    r = _with_server(go)
    # five output chunks (reasoning ×2, content, tool call ×2); the role and finish chunks are none
    assert r.ok and r.chunk_tokens == [1, 1, 1, 1, 1] and not r.chunk_tokens_exact
    assert r.first_token_s == r.chunk_times[0]
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.reasoning_tokens) == (50, 6, 32, 3)
    summary = metrics.usage_summary([r])
    assert summary["usage_prefix_hit_rate"] == pytest.approx(32 / 50)
    assert summary["reasoning_token_share"] == pytest.approx(3 / 6) and summary["server_token_counts"] is True


def test_a_replayed_session_sends_growing_histories_with_its_session_key():
    SEEN.clear()
    tree = agentx.generate(agentx.AgentXParams(num_sessions=1, turns=(4, 4), fork_prob=0.0, think_s=(0.0, 0.0)))[0]

    async def go(base: str):
        api = client.ApiConfig(base_url=f"{base}/t", model="m", continuous_usage=False)
        cfg = runner.RunConfig(api=api, max_concurrency=1, show_progress=False)
        texts = conversation.Conversations(textgen.BlockText(0, 64), "abc")
        return await runner.run_sessions(cfg, [tree], texts)

    res = _with_server(go)
    assert len(SEEN) == 4 and all(r.ok for r in res.records)
    key = f"abc-0-{tree.session_id}"
    for k, (body, headers) in enumerate(SEEN):
        assert headers["X-Session-ID"] == key and headers["X-Correlation-ID"] == key and body["user"] == key
        assert body["max_completion_tokens"] == tree.requests[k].output_length and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert len(body["messages"]) == 2 + 2 * k
        if k:
            assert body["messages"][:len(SEEN[k - 1][0]["messages"])] == SEEN[k - 1][0]["messages"]
    m = metrics.compute(res.records, res.end_s - res.start_s, res.start_s)
    assert m["usage_prefix_hit_rate_by_turn"] == {"0": 0.0, "1": 0.2, "2": 0.4, "3": 0.6}
    assert m["usage_prefix_hit_rate_later_turns"] == pytest.approx(0.4)
    assert m["total_reasoning_tokens"] == 4 and m["total_output_tokens"] == 8
