"""The generation endpoints: /v1/completions and /v1/chat/completions, streaming (SSE) and not.

Each (prompt, n) choice runs as its own engine request; their outputs are merged in arrival
order. The handler is cancelled when the client goes away (the app runs with handler
cancellation), and cancelling a choice's task aborts its engine request within one step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from msgspec.structs import replace

from ipc.messages import INT64_MAX, INT64_MIN, Finished, PromptLogprobs, TokenDelta

from . import offload
from .protocol import GenerationRequest, ProtocolError, checked, parse_chat, parse_completion
from .state import AppState, STATE
from .stream import ChoiceStream

logger = logging.getLogger(__name__)


def choice_seed(seed: int, choice: int) -> int:
    """Choice i of a seeded request with n > 1 samples with seed + i, wrapped into int64 (so a
    seed near the top of the range is still a valid, reproducible seed for every choice)."""
    span = INT64_MAX - INT64_MIN + 1
    return (seed + choice - INT64_MIN) % span + INT64_MIN


_JSON = msgspec.json.Decoder()


async def read_json(request: web.Request) -> Any:
    """The request body as JSON, or a 4xx naming what is wrong with it. msgspec's decoder
    refuses what a JSON body must not hold (invalid UTF-8, lone UTF-16 surrogates, NaN, a
    trailing tail), so every string that gets through can be encoded and tokenized."""
    state = request.app[STATE]
    try:
        async with asyncio.timeout(state.body_timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise ProtocolError(f"the request body did not arrive within {state.body_timeout_s:g} s", None,
                            "body_timeout", status=408) from None
    except web.HTTPRequestEntityTooLarge:
        raise ProtocolError(f"request body exceeds {state.limits.max_body_bytes} bytes", None,
                            "body_too_large", status=413) from None
    except (HttpProcessingError, RequestPayloadError) as exc:  # e.g. Content-Encoding: gzip on a body that isn't
        reason = " ".join(str(getattr(exc, "message", exc)).split())
        raise ProtocolError(f"the request body cannot be read: {reason}", None, "invalid_body") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"the request body is not valid UTF-8 (at byte {exc.start})", None, "invalid_body") from None
    try:
        return _JSON.decode(text)
    except RecursionError:
        raise ProtocolError("the request body is nested too deeply", None, "invalid_json") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        reason = "lone UTF-16 surrogate or truncated" if "truncated" in str(exc) else str(exc)
        raise ProtocolError(f"the request body is not valid JSON ({reason})", None, "invalid_json") from None


async def _prompt_ids(state: AppState, req: GenerationRequest) -> list[list[int]]:
    if req.messages is not None:
        return [await offload.encode_chat(state.tokenizer, req.messages)]  # ValueError → 400 (messages)
    out = []
    for p in req.prompts:
        ids = await offload.encode(state.tokenizer, p) if isinstance(p, str) else p
        vocab = state.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise ProtocolError(f"token id {bad} in 'prompt' is outside the vocabulary [0, {vocab})", "prompt",
                                "invalid_value")
        out.append(ids)
    return out


def _fit_context(state: AppState, req: GenerationRequest, prompts: list[list[int]]) -> None:
    limit = state.max_model_len
    param = "max_completion_tokens" if req.messages is not None else "max_tokens"
    for ids in prompts:
        if len(ids) >= limit:
            raise ProtocolError(f"the prompt has {len(ids)} tokens; the model's context length is {limit} tokens",
                                "messages" if req.messages is not None else "prompt", "context_length_exceeded")
        if req.max_tokens_given and len(ids) + req.params.max_tokens > limit:
            raise ProtocolError(
                f"this model's maximum context length is {limit} tokens, but the request asks for "
                f"{len(ids) + req.params.max_tokens} tokens ({len(ids)} in the prompt plus {req.params.max_tokens} "
                f"for the completion)", param, "context_length_exceeded")
    if not req.max_tokens_given:  # default: the rest of the context
        req.params = checked(replace(req.params, max_tokens=limit - max(map(len, prompts))))


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_completion(await read_json(request), state.limits, state.served_names)
    return await _generate(request, state, req, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_chat(await read_json(request), state.limits, state.served_names)
    return await _generate(request, state, req, chat=True)


async def _generate(request: web.Request, state: AppState, req: GenerationRequest, chat: bool) -> web.StreamResponse:
    if req.params.structured is not None and state.grammar_checker is not None:
        await state.grammar_checker.check(req.params.structured)  # 400 unless it compiles within the deadline
    try:
        prompts = await _prompt_ids(state, req)  # large inputs tokenize off the event loop
    except ValueError as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(str(exc), "messages", "invalid_value") from None
    _fit_context(state, req, prompts)
    n_choices = len(prompts) * req.n
    with state.admit(n_choices):  # raises 429/503 when overloaded or draining
        run = _Run(state, req, prompts, chat)
        if req.stream:
            return await run.stream(request)
        return await run.complete()


def _engine_error(message: str, code: int) -> ProtocolError:
    """The OpenAI error for a request the engine refused (4xx) or failed (5xx)."""
    status = code if 400 <= code <= 599 else 500
    return ProtocolError(message, None, "engine_error", status=status,
                         err_type="server_error" if status >= 500 else "invalid_request_error")


class _Run:
    """One HTTP request's choices, running concurrently in the engine."""

    def __init__(self, state: AppState, req: GenerationRequest, prompts: list[list[int]], chat: bool):
        self.state, self.req, self.prompts, self.chat = state, req, prompts, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [ChoiceStream(i, state.tokenizer, req.stop) for i in range(len(prompts) * req.n)]
        self.events: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.disconnected = True  # until the response completes, a cancellation means the client left
        self.kv_transfer_params = None  # PD: where a prefill for a remote decode holds the KV

    # ---- engine side -------------------------------------------------------------------------
    def _start(self) -> None:
        for i, choice in enumerate(self.choices):
            ids = self.prompts[i // self.req.n]
            params = self.req.params
            if params.seed is not None and self.req.n > 1:
                params = replace(params, seed=choice_seed(params.seed, i % self.req.n))  # distinct, reproducible
            self.tasks.append(asyncio.ensure_future(self._pump(choice, ids, params)))

    async def _pump(self, choice: ChoiceStream, ids: list[int], params) -> None:
        timer = self.state.metrics_timer()
        try:
            await self._consume(choice, ids, params, timer)
        except asyncio.CancelledError:
            if choice.state.finish_reason is None:  # the client went away (or the deadline passed)
                timer.abort(len(ids), len(choice.state.token_ids), client_disconnected=self.disconnected)
            raise
        except Exception as exc:  # the choice failed (e.g. its request could not be sent): report it
            logger.exception("choice %d of %s failed", choice.state.index, self.id)
            await self.events.put((choice, ProtocolError(f"request failed: {type(exc).__name__}: {exc}", None,
                                                         "engine_error", status=500, err_type="server_error"), 0, True))
        finally:
            timer.finish(choice.state.finish_reason or "abort", len(ids), len(choice.state.token_ids))

    async def _consume(self, choice: ChoiceStream, ids: list[int], params, timer) -> None:
        kv = {"kv_transfer_params": self.req.kv_transfer_params} if self.req.kv_transfer_params is not None else {}
        async for item in self.state.client.generate(ids, params, session=self.req.user, **kv):
            if isinstance(item, Finished):
                timer.scheduled(timer.arrival + item.queued_s)  # the worker measured the queue
                if item.kv_transfer_params is not None:
                    self.kv_transfer_params = item.kv_transfer_params
                if item.error and not choice.state.token_ids:
                    await self.events.put((choice, _engine_error(item.error, item.error_code), 0, True))
                    return
                await self.events.put((choice, choice.feed(item), 0, True))
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
                await self.events.put((choice, text, len(item.token_ids), choice.stopped))
                if choice.stopped:  # a stop string ended it (finish_reason is set); the finally aborts
                    return

    async def _events(self):
        """Yield (choice, text or error, new tokens, last) until every choice has sent its last
        event. `last` is decided when the event is queued: a choice's state runs ahead of the
        queue (its Finished can be folded in before an earlier delta is read), so reading
        `finish_reason` at the consumer counted one choice as ended twice and cut another short."""
        self._start()
        remaining = len(self.choices)
        deadline = self.state.request_timeout_s
        try:
            async with asyncio.timeout(deadline):
                while remaining:
                    choice, payload, n, last = await self.events.get()
                    remaining -= last
                    yield choice, payload, n, last
        except TimeoutError:
            self.disconnected = False
            for choice in self.choices:
                if choice.state.finish_reason is None:
                    text = choice.finish("abort")
                    yield choice, text, 0, True
        finally:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)

    # ---- responses -----------------------------------------------------------------------------
    async def complete(self) -> web.Response:
        async with aclosing(self._events()) as events:  # leaving early cancels every choice at once
            async for choice, payload, _, _ in events:
                if isinstance(payload, ProtocolError):
                    raise payload
                if choice.state.finish_reason == "error" and choice.state.error:  # failed after some tokens
                    raise _engine_error(choice.state.error, choice.state.error_code)
        choices = [self._final_choice(c) for c in self.choices]
        body = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.req.model, "choices": choices, "usage": self._usage()}
        if self.kv_transfer_params is not None:  # PD leg 1: what the proxy hands to the decode server
            from engine.kv_transfer.protocol import params_to_json

            body["kv_transfer_params"] = params_to_json(self.kv_transfer_params)
        return web.json_response(body)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        if self.chat:
            for c in self.choices:
                await self._send(resp, self._chunk(c, {"role": "assistant", "content": ""}, None))
        try:
            async with aclosing(self._events()) as events:
                async for choice, payload, _, last in events:
                    if isinstance(payload, ProtocolError):  # after the 200: one error event, then [DONE]
                        await self._send(resp, payload.body())
                        return await self._end(resp)
                    await self._send_delta(resp, choice, payload, last)
                    if last and choice.state.finish_reason == "error" and choice.state.error:  # after some tokens
                        await self._send(resp, _engine_error(choice.state.error, choice.state.error_code).body())
        except ConnectionResetError:  # the client went away mid-write: one line, and its requests abort
            logger.info("stream %s: client disconnected", self.id)
            return resp
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never a half-written stream without a reason
            logger.exception("stream %s failed", self.id)
            await self._send(resp, ProtocolError(f"internal error: {type(exc).__name__}", None, "internal_error",
                                                 status=500, err_type="server_error").body())
            return await self._end(resp)
        if self.req.include_usage:
            await self._send(resp, {"id": self.id, "object": self._chunk_object, "created": self.created,
                                    "model": self.req.model, "choices": [], "usage": self._usage()})
        return await self._end(resp)

    @staticmethod
    async def _end(resp: web.StreamResponse) -> web.StreamResponse:
        """Every stream ends with [DONE], an error or not (as vLLM's do): a client reading to the
        sentinel never mistakes a failed request for a cut connection."""
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    async def _send(self, resp: web.StreamResponse, obj: dict) -> None:
        await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

    async def _send_delta(self, resp, choice: ChoiceStream, text: str, last: bool) -> None:
        """One chunk for a choice's event; its finish_reason goes out once, with its last event."""
        st = choice.state
        finish = st.finish_reason if last else None
        new_tokens = st.token_ids[getattr(choice, "sent_tokens", 0):]
        lp = self._logprobs(choice, getattr(choice, "sent_tokens", 0)) if self.req.logprobs is not None else None
        choice.sent_tokens = len(st.token_ids)
        if not text and not new_tokens and finish is None:
            return
        if self.chat:
            delta = {"content": text} if text or finish is None else {}
            chunk = self._chunk(choice, delta, finish, lp)
        else:
            body = {"index": st.index, "text": text, "logprobs": lp, "finish_reason": finish}
            chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.req.model,
                     "choices": [body]}
        if self.req.continuous_usage:  # running totals, so clients can count tokens per chunk exactly
            chunk["usage"] = self._usage()
        await self._send(resp, chunk)

    def _chunk(self, choice: ChoiceStream, delta: dict, finish: str | None, lp: Any = None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.req.model,
                "choices": [{"index": choice.state.index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    def _final_choice(self, choice: ChoiceStream) -> dict:
        st = choice.state
        lp = self._logprobs(choice, 0) if self.req.logprobs is not None else None
        if self.chat:
            return {"index": st.index, "message": {"role": "assistant", "content": st.text}, "logprobs": lp,
                    "finish_reason": st.finish_reason}
        text = st.text
        prompt = self.prompts[st.index // self.req.n]
        if self.req.echo:
            text = self.state.tokenizer.decode(prompt) + text
            if lp is not None and st.prompt is not None:
                lp = _echo_logprobs(self.state.tokenizer, prompt, st.prompt, self.req.logprobs, lp)
        body = {"index": st.index, "text": text, "logprobs": lp, "finish_reason": st.finish_reason}
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = _vllm_prompt_logprobs(self.state.tokenizer, prompt, st.prompt,
                                                            self.req.prompt_logprobs)
        return body

    def _logprobs(self, choice: ChoiceStream, start: int) -> dict:
        st, tok = choice.state, self.state.tokenizer
        ids = st.token_ids[start:]
        lps = st.logprobs[start : start + len(ids)]
        tops = st.top_logprobs[start : start + len(ids)]
        pieces = [tok.decode([t], skip_special_tokens=False) for t in ids]
        if self.chat:
            return {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()),
                                 "top_logprobs": [{"token": tok.decode([t], skip_special_tokens=False), "logprob": v,
                                                   "bytes": list(tok.decode([t], skip_special_tokens=False).encode())}
                                                  for t, v in top]}
                                for p, lp, top in zip(pieces, lps, tops)]}
        offsets, pos = [], len(st.text)
        for p in pieces:
            offsets.append(pos)
            pos += len(p)
        return {"tokens": pieces, "token_logprobs": lps,
                "top_logprobs": [{tok.decode([t], skip_special_tokens=False): v for t, v in top} for top in tops],
                "text_offset": offsets}

    def _usage(self) -> dict:
        prompt = sum(len(self.prompts[i // self.req.n]) for i in range(len(self.choices)) if i % self.req.n == 0)
        completion = sum(len(c.state.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _echo_logprobs(tok, prompt: list[int], scores: PromptLogprobs, top_n: int, completion: dict) -> dict:
    """OpenAI legacy completions `logprobs` with the prompt echoed: the prompt's tokens first
    (the first one unscored: null), then the completion's. Offsets index the echoed text, in which
    special tokens (BOS) take no characters."""
    pieces = [tok.decode([t], skip_special_tokens=False) for t in prompt]
    tops = [{tok.decode([t], skip_special_tokens=False): v for t, v in row[:top_n]} for row in scores.top_logprobs]
    offsets, pos = [], 0
    for t in prompt:
        offsets.append(pos)
        pos += len(tok.decode([t]))
    for p in completion["tokens"]:
        offsets.append(pos)
        pos += len(p)
    return {"tokens": pieces + completion["tokens"], "token_logprobs": [None, *scores.logprobs,
                                                                         *completion["token_logprobs"]],
            "top_logprobs": [None, *tops, *completion["top_logprobs"]], "text_offset": offsets}


def _vllm_prompt_logprobs(tok, prompt: list[int], scores: PromptLogprobs | None, top_n: int) -> list | None:
    """vLLM's `prompt_logprobs`: null for the first token, then per token {token id: {logprob,
    rank, decoded_token}} holding the prompt token itself and the top_n most likely."""
    if scores is None:
        return None
    out: list = [None]
    for t, lp, rank, top in zip(prompt[1:], scores.logprobs, scores.ranks, scores.top_logprobs):
        entry = {str(t): {"logprob": lp, "rank": rank, "decoded_token": tok.decode([t], skip_special_tokens=False)}}
        for r, (alt, v) in enumerate(top[:top_n], start=1):
            entry.setdefault(str(alt), {"logprob": v, "rank": r,
                                        "decoded_token": tok.decode([alt], skip_special_tokens=False)})
        out.append(entry)
    return out
