"""The engine side of one API request, shared by every API (OpenAI completions and chat,
Anthropic Messages, OpenAI Responses): its choices run as engine requests and their outputs come
back as one stream of events.

Each (prompt, n) choice runs as its own engine request; their outputs are merged in arrival
order. The handler is cancelled when the client goes away (the app runs with handler
cancellation), and cancelling a choice's task aborts its engine request within one step. The
request deadline (`request_timeout_s`) ends every unfinished choice with `abort`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from msgspec.structs import replace

from ipc.messages import INT64_MAX, INT64_MIN, Finished, TokenDelta

from .errors import ProtocolError
from .protocol import GenerationRequest
from .state import AppState
from .stream import ChoiceStream

logger = logging.getLogger(__name__)


def choice_seed(seed: int, choice: int) -> int:
    """Choice i of a seeded request with n > 1 samples with seed + i, wrapped into int64 (so a
    seed near the top of the range is still a valid, reproducible seed for every choice)."""
    span = INT64_MAX - INT64_MIN + 1
    return (seed + choice - INT64_MIN) % span + INT64_MIN


def engine_error(message: str, code: int) -> ProtocolError:
    """The error for a request the engine refused (4xx) or failed (5xx)."""
    status = code if 400 <= code <= 599 else 500
    return ProtocolError(message, None, "engine_error", status=status,
                         err_type="server_error" if status >= 500 else "invalid_request_error")


@dataclass(frozen=True, slots=True)
class ChoiceEvent:
    choice: ChoiceStream
    text: str  # new text (may be empty)
    new_tokens: int
    last: bool  # the choice's last event (its finish_reason is set)
    error: ProtocolError | None = None  # the choice failed before any output


class Generation:
    """One request's choices, running concurrently in the engine."""

    def __init__(self, state: AppState, req: GenerationRequest, prompts: list[list[int]],
                 keep_special_tokens: bool = False):
        self.state, self.req, self.prompts = state, req, prompts
        self.choices = [ChoiceStream(i, state.tokenizer, req.stop, skip_special_tokens=not keep_special_tokens)
                        for i in range(len(prompts) * req.n)]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self.disconnected = True  # until the response completes, a cancellation means the client left
        self.kv_transfer_params = None  # PD: where a prefill for a remote decode holds the KV

    def prompt_of(self, choice: ChoiceStream) -> list[int]:
        return self.prompts[choice.state.index // self.req.n]

    def _start(self) -> None:
        for i, choice in enumerate(self.choices):
            params = self.req.params
            if params.seed is not None and self.req.n > 1:
                params = replace(params, seed=choice_seed(params.seed, i % self.req.n))  # distinct, reproducible
            self._tasks.append(asyncio.ensure_future(self._pump(choice, self.prompt_of(choice), params)))

    async def _pump(self, choice: ChoiceStream, ids: list[int], params) -> None:
        timer = self.state.metrics_timer()
        try:
            await self._consume(choice, ids, params, timer)
        except asyncio.CancelledError:
            if choice.state.finish_reason is None:  # the client went away (or the deadline passed)
                timer.abort(len(ids), len(choice.state.token_ids), client_disconnected=self.disconnected)
            raise
        except Exception as exc:  # the choice failed (e.g. its request could not be sent): report it
            logger.exception("choice %d failed", choice.state.index)
            error = ProtocolError(f"request failed: {type(exc).__name__}: {exc}", None, "engine_error", status=500,
                                  err_type="server_error")
            await self._queue.put(ChoiceEvent(choice, "", 0, True, error))
        finally:
            timer.finish(choice.state.finish_reason or "abort", len(ids), len(choice.state.token_ids))

    async def _consume(self, choice: ChoiceStream, ids: list[int], params, timer) -> None:
        kw = {"kv_transfer_params": self.req.kv_transfer_params} if self.req.kv_transfer_params is not None else {}
        if self.req.images:
            kw["images"] = self.req.images
        async for item in self.state.client.generate(ids, params, session=self.req.user, **kw):
            if isinstance(item, Finished):
                timer.scheduled(timer.arrival + item.queued_s)  # the worker measured the queue
                if item.kv_transfer_params is not None:
                    self.kv_transfer_params = item.kv_transfer_params
                if item.error and not choice.state.token_ids:
                    await self._queue.put(ChoiceEvent(choice, "", 0, True, engine_error(item.error, item.error_code)))
                    return
                await self._queue.put(ChoiceEvent(choice, choice.feed(item), 0, True))
                return
            if self.req.score_only:  # max_tokens 0: keep the prompt scores, leave the sampled token out
                choice.feed(TokenDelta(item.request_id, [], None, None, item.prompt))
                continue
            if item.token_ids:
                if choice.state.token_ids:
                    timer.tokens(len(item.token_ids))
                else:
                    timer.first_token(n=len(item.token_ids))
                text = choice.feed(item)
                await self._queue.put(ChoiceEvent(choice, text, len(item.token_ids), choice.stopped))
                if choice.stopped:  # a stop string ended it (finish_reason is set); the finally aborts
                    return

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every choice's events until each has sent its last. `last` is decided when the event
        is queued: a choice's state runs ahead of the queue (its Finished can be folded in before
        an earlier delta is read), so reading `finish_reason` at the consumer counted one choice
        as ended twice and cut another short. Use inside `aclosing`: leaving early cancels every
        choice at once."""
        self._start()
        remaining = len(self.choices)
        try:
            async with asyncio.timeout(self.state.request_timeout_s):
                while remaining:
                    event = await self._queue.get()
                    remaining -= event.last
                    yield event
        except TimeoutError:
            self.disconnected = False
            for choice in self.choices:
                if choice.state.finish_reason is None:
                    yield ChoiceEvent(choice, choice.finish("abort"), 0, True)
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def usage(self, reasoning_tokens: int | None = None) -> dict:
        """OpenAI usage: prompt tokens once per prompt, the prefix-cache hits among them (vLLM's
        `prompt_tokens_details.cached_tokens`), every choice's completion tokens, and (chat, when
        the model reasons) how many of those were reasoning."""
        firsts = [c for c in self.choices if c.state.index % self.req.n == 0]
        prompt = sum(len(self.prompt_of(c)) for c in firsts)
        cached = sum(c.state.cached_tokens for c in firsts)
        completion = sum(len(c.state.token_ids) for c in self.choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage
