"""server/offload.py: large tokenizer work on the pool gives exactly what the Tokenizer gives
(ids, chat ids, text, errors), and the event loop keeps running while it happens."""
from __future__ import annotations

import asyncio
import random
import string

import pytest

from server import offload
from server.builtin import builtin_model_dir
from server.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(builtin_model_dir())


def _text(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    pieces = ["".join(rng.choices(string.ascii_letters + "äöü€ ", k=rng.randint(1, 9))) for _ in range(n // 5)]
    return " ".join(pieces)[:n]


def test_large_inputs_give_what_the_tokenizer_gives(tok):
    text = _text(5 * offload.INLINE_CHARS)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]

    async def run():
        return (await offload.encode(tok, text), await offload.encode(tok, text, add_bos=False),
                await offload.encode(tok, "short"), await offload.encode_chat(tok, messages))

    ids, no_bos, short, chat = asyncio.run(run())
    assert ids == tok.encode(text) and no_bos == tok.encode(text, add_bos=False) and short == tok.encode("short")
    assert chat == tok.encode_chat(messages)
    many = (ids * (offload.INLINE_TOKENS // len(ids) + 2))[: offload.INLINE_TOKENS + 7]
    assert asyncio.run(offload.decode(tok, many)) == tok.decode(many)
    special = asyncio.run(offload.decode(tok, many, skip_special_tokens=False))
    assert special == tok.decode(many, skip_special_tokens=False)


def test_an_error_on_the_pool_is_the_same_error(tok):
    with pytest.raises(ValueError) as pooled:
        asyncio.run(offload.encode_chat(tok, [{"role": "user", "content": {"not": "text"}}]))
    with pytest.raises(ValueError) as direct:
        tok.encode_chat([{"role": "user", "content": {"not": "text"}}])
    assert type(pooled.value) is type(direct.value) and str(pooled.value) == str(direct.value)


def test_the_loop_runs_while_a_large_text_encodes(tok):
    """A ticker on the loop (5 ms sleeps) keeps ticking while ~1 MiB encodes: ~100 ticks per second
    of encoding here; with the single-text call on a thread (it holds the GIL) ~5, on the loop 0.
    The bound is a rate, 4x below what this machine does and 4x above the GIL-holding call."""
    text = _text(1 << 20, seed=1)

    async def run():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                await asyncio.sleep(0.005)
                ticks += 1

        task = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ids = await offload.encode(tok, text)
        took = loop.time() - t0
        done.set()
        await task
        return ids, ticks, took

    ids, ticks, took = asyncio.run(run())
    assert ids == tok.encode(text)
    assert ticks >= 20 * took, (ticks, took)


def test_the_tokenize_answer_is_the_json_of_the_tokenizers_ids(tok):
    import json

    messages = [{"role": "user", "content": _text(3 * offload.INLINE_CHARS, seed=2)}]
    for text, add_bos in (("", True), ("hi", False), (_text(3 * offload.INLINE_CHARS, seed=3), True)):
        body = asyncio.run(offload.tokenize_body(tok, text=text, add_bos=add_bos, max_model_len=4096))
        ids = tok.encode(text, add_bos=add_bos)
        assert json.loads(body) == {"tokens": ids, "count": len(ids), "max_model_len": 4096}
    body = json.loads(asyncio.run(offload.tokenize_body(tok, messages=messages, max_model_len=7)))
    assert body["tokens"] == tok.encode_chat(messages) and body["count"] == len(body["tokens"])
