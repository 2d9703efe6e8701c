"""Tokenizer work off the event loop: the front process keeps answering while large inputs encode.

A 4 MiB prompt takes seconds to tokenize, and `tokenizers`' single-text `encode` and `decode`
hold the GIL for all of it: run on the loop (or even on a thread) they stopped `/health`, every
stream and the systemd watchdog for that long. Here large texts go to a small thread pool and
through the library's batch calls, which release the GIL while the Rust code runs (built-in
tokenizer, 4 MiB of text: the loop's longest pause 57 ms with `encode_batch_fast`, 5 s with
`encode`). Chat templates render on the pool too (jinja2 is Python: it yields the GIL every few
milliseconds). What still holds the GIL in one piece is bounded: turning an encoding into a list
of ids (~50 ms for 4 MiB) is done by one pool thread at a time, long lists are freed and
JSON-encoded a slice at a time, and `/tokenize` builds its whole answer on the pool (a list of
millions of ids never reaches the loop, whose garbage collections would walk it). Small inputs
stay inline: a thread hop costs more than they do. perf/bench_front_flood.py measures `/health`
under 64 maximal requests.

The pool is bounded (`WORKERS` threads, at most `MAX_PENDING` jobs queued; later callers wait
their turn on the loop, holding nothing but their request), so a flood of large requests cannot
spawn threads or stack up work without limit. Once the pool drains after large inputs, glibc is
asked to return the freed memory to the system (`malloc_trim`): the big buffers are freed, but the
allocator would otherwise keep the pages (tokenizers' Rust allocations land in the pool threads'
malloc arenas, which glibc does not shrink on its own).

Token ids are the ones `Tokenizer.encode` / `encode_chat` / `decode` give (tested against them).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable

import msgspec

from .tokenizer import Tokenizer

INLINE_CHARS = 16 * 1024  # texts shorter than this encode on the loop
INLINE_TOKENS = 16 * 1024  # id lists shorter than this decode on the loop
WORKERS = max(1, min(4, os.cpu_count() or 1))
MAX_PENDING = 4 * WORKERS
TRIM_AFTER_S = 1.0  # idle this long after large work: hand freed memory back to the system


class _Pool:
    """The process's tokenizer pool (created on first use, on the running loop)."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="ringserve-tokenize")
        self.busy = 0  # jobs submitted and not finished (counted on the loop's thread)
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def slots(self, loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
        """The bound on queued jobs (one per event loop: a semaphore belongs to its loop)."""
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(MAX_PENDING))
        return self._slots[1]

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        async with self.slots(loop):
            self.busy += 1
            try:
                return await loop.run_in_executor(self.executor, fn, *args)
            finally:
                self.busy -= 1
                if self.busy == 0:  # after the callers have had time to drop their large results
                    loop.call_later(TRIM_AFTER_S, self._trim_if_idle, loop)

    def _trim_if_idle(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.busy == 0 and not loop.is_closed():
            loop.run_in_executor(self.executor, _trim_heap)


_pool: _Pool | None = None


def _get_pool() -> _Pool:
    global _pool
    if _pool is None:
        _pool = _Pool()
    return _pool


def _trim_heap() -> None:
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _load_libc()


# ---- what the handlers call ---------------------------------------------------------------------

async def run(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on the pool (e.g. rendering a long conversation in a chat format)."""
    return await _get_pool().run(fn, *args)


async def encode(tok: Tokenizer, text: str, add_bos: bool = True) -> list[int]:
    """`tok.encode(text, add_bos)`, off the loop when the text is large."""
    if len(text) < INLINE_CHARS:
        return tok.encode(text, add_bos=add_bos)
    ids = await _get_pool().run(_encode_released, tok, text)
    if add_bos:
        ids.insert(0, tok.bos_id)  # in place: a copy of millions of ids would hold the loop
    return ids


async def encode_chat(tok: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """`tok.encode_chat(messages)`: the template renders and the text encodes on the pool."""
    return await _get_pool().run(_encode_chat_released, tok, messages)


async def decode(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    """`tok.decode(ids)`, off the loop when there are many ids."""
    if len(ids) < INLINE_TOKENS:
        return tok.decode(ids, skip_special_tokens=skip_special_tokens)
    return await _get_pool().run(_decode_released, tok, ids, skip_special_tokens)


async def tokenize_body(tok: Tokenizer, *, text: str | None = None, add_bos: bool = True,
                        messages: list[dict[str, Any]] | None = None, max_model_len: int) -> bytes:
    """The `/tokenize` response for a text or chat messages: `{"tokens", "count", "max_model_len"}`
    as JSON bytes. A large one is built whole on the pool: a list of millions of ids never reaches
    the loop, whose garbage collections would otherwise walk it."""
    if text is not None and len(text) < INLINE_CHARS:
        return _tokens_json(tok.encode(text, add_bos=add_bos), max_model_len)
    return await _get_pool().run(_tokenize_body, tok, text, add_bos, messages, max_model_len)


# ---- on the pool's threads ----------------------------------------------------------------------

_JSON_CHUNK = 1 << 16


def _tokenize_body(tok: Tokenizer, text: str | None, add_bos: bool, messages: list[dict[str, Any]] | None,
                   max_model_len: int) -> bytes:
    if text is None:
        ids = _encode_chat_released(tok, messages)
    else:
        ids = _encode_released(tok, text)
        if add_bos:
            ids.insert(0, tok.bos_id)
    body = _tokens_json(ids, max_model_len)
    _free(ids)
    return body


def _tokens_json(ids: list[int], max_model_len: int) -> bytes:
    # Encoded a slice at a time: one call over millions of ids would hold the GIL (and so the
    # event loop) for its whole length; between slices the loop gets its turn.
    parts = [b'{"tokens":[']
    for start in range(0, len(ids), _JSON_CHUNK):
        if start:
            parts.append(b",")
        parts.append(msgspec.json.encode(ids[start:start + _JSON_CHUNK])[1:-1])
    parts.append(b'],"count":%d,"max_model_len":%d}' % (len(ids), max_model_len))
    return b"".join(parts)


# Turning an encoding into a Python list of ids (and freeing one) is one C call that holds the GIL
# for its whole length (~50 ms for 4 MiB of text). The pool's threads tokenize in parallel, but
# take turns here, so the event loop never waits for more than one such call at a time.
_TO_PYTHON = threading.Lock()
_FREE_CHUNK = 1 << 16


def _backend(tok: Tokenizer):
    # The `tokenizers.Tokenizer` inside: only its batch calls release the GIL, and Tokenizer's
    # own encode/decode use the single-text ones.
    return tok._backend


def _encode_released(tok: Tokenizer, text: str) -> list[int]:
    backend = _backend(tok)
    batch = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: no offsets computed
    encoding = batch([text], add_special_tokens=False)[0]  # the GIL is released while this runs
    with _TO_PYTHON:
        ids = encoding.ids
        del encoding
    return ids


def _free(ids: list[int]) -> None:
    """Drop a long list a slice at a time (freeing it whole is one long GIL-holding call)."""
    while ids:
        del ids[-_FREE_CHUNK:]


def _encode_chat_released(tok: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    return _encode_released(tok, tok.apply_chat_template(messages))


def _decode_released(tok: Tokenizer, ids: Iterable[int], skip_special_tokens: bool) -> str:
    return _backend(tok).decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
