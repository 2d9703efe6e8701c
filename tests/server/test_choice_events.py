"""A request's choices end when their engine streams end — not when their state says so.

A choice's state (tokens, finish_reason) is folded in by its own task as outputs arrive, ahead of
the queue its events wait in for the response writer; a fast choice can be finished in its state
while its earlier delta is still queued. Served for real (the aiohttp app on a thread, the
official `openai` client) over an engine stand-in whose first choice delivers a delta and its
Finished at once while the second is still generating."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import openai
import pytest
from aiohttp import web

from ipc.messages import Finished, TokenDelta
from server.app import make_app
from server.state import AppState
from server.tokenizer import Tokenizer

BUILTIN = Path(__file__).resolve().parents[2] / "server" / "builtin_model"
TOKENS = [[72, 73], [74, 75, 76, 77]]  # per choice; the second arrives one token at a time


class BurstThenSlowEngine:
    """Stand-in for EngineClient: choice 0 all at once, choice 1 a token per 20 ms."""

    healthy, stuck = True, {}

    def __init__(self):
        self.calls = 0

    async def generate(self, prompt_token_ids, params, session=None, **kv):
        i, self.calls = self.calls, self.calls + 1
        rid, tokens = 1000 + i, TOKENS[i % 2]
        if i % 2 == 0:
            yield TokenDelta(rid, tokens)  # no await between: both are folded in before the writer reads
            yield Finished(rid, "length", len(prompt_token_ids), len(tokens))
            return
        for t in tokens:
            await asyncio.sleep(0.02)
            yield TokenDelta(rid, [t])
        yield Finished(rid, "length", len(prompt_token_ids), len(tokens))

    def abort(self, request_id):
        pass


@pytest.fixture(scope="module")
def url():
    tok = Tokenizer.from_dir(BUILTIN)
    state = AppState(client=BurstThenSlowEngine(), tokenizer=tok, served_names=["stand-in"], vocab_size=8192,
                     max_model_len=512)
    state.ready = True
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app(state))
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}/v1"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_every_choice_runs_to_its_end(url):
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
    out = client.completions.create(model="stand-in", prompt="hi", n=2, max_tokens=4)
    by_index = {c.index: c for c in out.choices}
    assert [by_index[i].finish_reason for i in (0, 1)] == ["length", "length"]
    assert out.usage.completion_tokens == sum(map(len, TOKENS))


def test_a_streamed_choice_sends_its_finish_reason_once_and_last(url):
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
    chunks = list(client.completions.create(model="stand-in", prompt="hi", n=2, max_tokens=4, stream=True))
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        finishes = [c.finish_reason for c in mine]
        assert finishes.count("length") == 1 and finishes[-1] == "length", finishes
