"""OpenAI's generation endpoints: /v1/completions and /v1/chat/completions, streamed (SSE) or not.

A request's way: parse (server/protocol.py) → prompt ids (completions: encode; chat: render
with the model family's chat format, server/chat_render.py, then encode) → run its choices in
the engine (server/run.py `Generation`) → shape the events as OpenAI's responses (chat: each
choice's text read into reasoning, content and tool calls by server/chat_output.py). The
Anthropic and Responses endpoints take the same way through `prepare_chat` and `Generation`.
"""

from __future__ import annotations

import asyncio
import dataclasses
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

from ipc.messages import PromptLogprobs
from ipc.prompt_checks import ContextExceeded, TokenOutsideVocabulary, check_context, check_token_ids

from . import offload
from .chat import ContentDelta, ReasoningDelta, ToolCallArgumentsDelta, ToolCallStart
from .chat.deepseek_format import IMAGE_PLACEHOLDER
from .chat_output import ChatOutput
from .chat_render import Rendered
from .protocol import GenerationRequest, ProtocolError, checked, parse_chat, parse_completion
from .run import ChoiceEvent, Generation, engine_error
from .state import AppState, STATE
from .stream import ChoiceStream

logger = logging.getLogger(__name__)


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
    if len(raw) > _DECODE_ON_LOOP_MAX:  # a large body parses on the pool: the loop keeps answering meanwhile
        return await offload.run(_parse_json_body, raw)
    return _parse_json_body(raw)


_DECODE_ON_LOOP_MAX = 64 << 10  # bytes; a few hundred microseconds of decoding


def _parse_json_body(raw: bytes) -> Any:
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


# ---- from a request to its prompt ids -------------------------------------------------------------


async def _completion_prompts(state: AppState, req: GenerationRequest) -> list[list[int]]:
    out = []
    for p in req.prompts:
        ids = await offload.encode(state.tokenizer, p) if isinstance(p, str) else p  # large ones off the loop
        try:
            check_token_ids(ids, state.vocab_size)
        except TokenOutsideVocabulary as exc:
            raise ProtocolError(f"token id {exc.token_id} in 'prompt' is outside the vocabulary [0, {exc.vocab_size})",
                                "prompt", "invalid_value") from None
        out.append(ids)
    return out


async def prepare_chat(state: AppState, req: GenerationRequest) -> tuple[list[int], Rendered]:
    """A chat request's prompt ids, through the model family's renderer (off the loop: a long
    conversation renders and encodes on the pool), its grammar settled (a forced tool choice, or
    a response format that starts after the reasoning) and checked, its images (if any) loaded
    and their spans expanded into the ids (`req.images`). Every chat API calls this."""
    rendered, image_urls = await render_chat(state, req.chat)
    structured = state.renderer.grammar(req.chat, rendered, req.params.structured)
    if structured is not req.params.structured:
        req.params = checked(replace(req.params, structured=structured))
    await _check_grammar(state, req)
    ids = await offload.encode(state.tokenizer, rendered.text, add_bos=False)  # the text holds its BOS
    if image_urls is not None:
        ids = await _with_images(state, req, ids, image_urls)
    _fit_context(state, req, [ids])
    return ids, rendered


async def render_chat(state: AppState, chat) -> tuple[Rendered, tuple[list, list] | None]:
    """The rendered prompt, and for a request with images their (URLs, places) in placeholder
    order (server/multimodal.py: rendered with markers, which then become the image token)."""
    from . import multimodal

    if not multimodal.has_images(chat.messages):
        return await offload.run(state.renderer.render, chat), None
    mm = state.multimodal
    if mm is None or mm.refusal is not None:
        raise ProtocolError(mm.refusal if mm is not None else "this server takes no image input", "messages",
                            "images_not_supported")
    if not state.renderer.renders_images:
        raise ProtocolError("images need DeepSeek-V4.1's chat format (--tokenizer-mode deepseek_v41)", "messages",
                            "images_not_supported")
    marked = multimodal.mark_images(chat.messages)
    rendered = await offload.run(state.renderer.render, dataclasses.replace(chat, messages=marked.messages))
    text, order = marked.placeholders(rendered.text, IMAGE_PLACEHOLDER)
    mm.check_accepts(len(order))
    sources = ([marked.urls[k] for k in order], [marked.places[k] for k in order])
    return dataclasses.replace(rendered, text=text), sources


async def chat_prompt_ids(state: AppState, chat) -> list[int] | None:
    """/tokenize and count_tokens of a conversation with images: the ids it would run with, its
    image spans expanded (the images loaded and preprocessed to know their sizes). None: no images
    (the caller tokenizes the text its own way)."""
    rendered, image_urls = await render_chat(state, chat)
    if image_urls is None:
        return None
    ids = await offload.encode(state.tokenizer, rendered.text, add_bos=False)
    return state.multimodal.expand(ids, await state.multimodal.load(*image_urls))[0]


async def _with_images(state: AppState, req: GenerationRequest, ids: list[int],
                       image_urls: tuple[list, list]) -> list[int]:
    """The prompt with its image spans, and the images on `req`. Both PD legs carry them: a
    DeepSeek-V4.1 decode leg replays the prompt's last positions (the window stack's receptive
    field), which may hold an image span (the engine then places its rows; else it never reads
    them). A decode leg given the prefill's `prefilled_images` checks that it loaded the same
    images (an http image that changed between the legs is refused)."""
    from .multimodal import PrefilledImage

    mm = state.multimodal
    kv = req.kv_transfer_params
    decode_leg = kv is not None and kv.do_remote_prefill
    if req.prefilled_images is not None and not decode_leg:
        raise ProtocolError("'prefilled_images' is only valid on a PD decode leg", "prefilled_images", "invalid_value")
    images = await mm.load(*image_urls)
    loaded = [PrefilledImage(im.n_vit_h, im.n_vit_w, im.digest) for im in images]
    if decode_leg and req.prefilled_images is not None and req.prefilled_images != loaded:
        raise ProtocolError("the images differ from those the prefill leg computed (an image URL changed between "
                            "the legs?)", "prefilled_images", "invalid_value")
    ids, req.images = mm.expand(ids, images)
    req.prefilled_images = loaded
    return ids


async def _check_grammar(state: AppState, req: GenerationRequest) -> None:
    """400 unless the request's grammar compiles within the deadline. Not on PD's decode leg: the
    prefill server checked the same specification, and the prefill's KV lease is running."""
    kv = req.kv_transfer_params
    if req.params.structured is None or state.grammar_checker is None or (kv is not None and kv.do_remote_prefill):
        return
    await state.grammar_checker.check(req.params.structured)


def session_of(request: web.Request, user: str | None) -> str | None:
    """The DP / prefix-cache affinity key: `user`, else a session header agent harnesses send
    (AIPerf's X-Session-ID / X-Correlation-ID)."""
    if user:
        return user
    for header in ("X-Session-ID", "X-Correlation-ID"):
        value = request.headers.get(header)
        if value:
            return value[:256]
    return None


def _fit_context(state: AppState, req: GenerationRequest, prompts: list[list[int]]) -> None:
    """400 (OpenAI's context_length_exceeded) unless every prompt leaves room for one token and,
    when the request sets it, for max_tokens; without it, max_tokens becomes the rest."""
    limit = state.max_model_len
    try:
        for ids in prompts:
            check_context(len(ids), None, limit)
            if req.max_tokens_given:
                check_context(len(ids), req.params.max_tokens, limit)
    except ContextExceeded as exc:
        raise _context_error(exc, req) from None
    if not req.max_tokens_given:  # default: the rest of the context
        req.params = checked(replace(req.params, max_tokens=limit - max(map(len, prompts))))


def _context_error(exc: ContextExceeded, req: GenerationRequest) -> ProtocolError:
    if exc.max_tokens is None:  # the prompt alone fills the context
        return ProtocolError(str(exc), "messages" if req.chat is not None else "prompt", "context_length_exceeded")
    total = exc.prompt_tokens + exc.max_tokens
    return ProtocolError(
        f"this model's maximum context length is {exc.max_model_len} tokens, but the request asks for {total} "
        f"tokens ({exc.prompt_tokens} in the prompt plus {exc.max_tokens} for the completion)",
        "max_completion_tokens" if req.chat is not None else "max_tokens", "context_length_exceeded")


# ---- the endpoints -----------------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_completion(await read_json(request), state.limits, state.served_names)
    req.user = session_of(request, req.user)
    await _check_grammar(state, req)
    prompts = await _completion_prompts(state, req)
    _fit_context(state, req, prompts)
    with state.admit(len(prompts) * req.n):  # raises 429/503 when overloaded or draining
        return await _OpenAIResponse(state, req, Generation(state, req, prompts), None).send(request)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_chat(await read_json(request), state.limits, state.served_names)
    req.user = session_of(request, req.user)
    ids, rendered = await prepare_chat(state, req)
    outputs = [ChatOutput(rendered, req.chat.parses_tool_calls, state.renderer.think_end_id) for _ in range(req.n)]
    with state.admit(req.n):
        gen = Generation(state, req, [ids], keep_special_tokens=outputs[0].keeps_special_tokens)
        return await _OpenAIResponse(state, req, gen, outputs).send(request)


# ---- OpenAI's response shapes ------------------------------------------------------------------------


class _OpenAIResponse:
    """A completions or chat response (`outputs`: each chat choice's reader; None for
    completions), whole or as server-sent events."""

    def __init__(self, state: AppState, req: GenerationRequest, gen: Generation, outputs: list[ChatOutput] | None):
        self.state, self.req, self.gen, self.outputs = state, req, gen, outputs
        self.chat = outputs is not None
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.messages: dict[int, dict] = {}  # chat: each choice's final message (MessageDone)
        self.sent_tokens: dict[int, int] = {}

    async def send(self, request: web.Request) -> web.StreamResponse:
        return await (self.stream(request) if self.req.stream else self.complete())

    def _usage(self) -> dict:
        if not self.chat:
            return self.gen.usage()
        reasoning = sum(self.outputs[c.state.index].reasoning_tokens(c.state.token_ids) for c in self.gen.choices)
        return self.gen.usage(reasoning)

    def _finish_reason(self, choice: ChoiceStream) -> str | None:
        reason = choice.state.finish_reason
        message = self.messages.get(choice.state.index)
        if self.chat and reason == "stop" and message is not None and message.get("tool_calls"):
            return "tool_calls"
        return reason

    # ---- whole ---------------------------------------------------------------------------------------
    async def complete(self) -> web.Response:
        async with aclosing(self.gen.events()) as events:  # leaving early cancels every choice at once
            async for event in events:
                if event.error is not None:
                    raise event.error
                choice = event.choice
                if event.last and choice.state.finish_reason == "error" and choice.state.error:  # after some tokens
                    raise engine_error(choice.state.error, choice.state.error_code)
                if self.chat:
                    self._chat_events(event)
        choices = [self._final_choice(c) for c in self.gen.choices]
        body = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.req.model, "choices": choices, "usage": self._usage()}
        if self.gen.kv_transfer_params is not None:  # PD leg 1: what the proxy hands to the decode server
            from engine.kv_transfer.protocol import params_to_json

            body["kv_transfer_params"] = params_to_json(self.gen.kv_transfer_params)
            if self.req.images:  # what the decode leg needs to lay out the same image spans
                body["prefilled_images"] = [p.to_json() for p in self.req.prefilled_images]
        return web.json_response(body)

    def _chat_events(self, event: ChoiceEvent) -> list:
        """The choice's output events for this engine event (its final message kept)."""
        out = self.outputs[event.choice.state.index]
        events = out.feed(event.text)
        if event.last:
            events += out.finish()
            self.messages[event.choice.state.index] = events[-1].message
        return events

    def _final_choice(self, choice: ChoiceStream) -> dict:
        st = choice.state
        lp = self._logprobs(choice, 0) if self.req.logprobs is not None else None
        if self.chat:
            return {"index": st.index, "message": openai_message(self.messages[st.index]), "logprobs": lp,
                    "finish_reason": self._finish_reason(choice)}
        text = st.text
        prompt = self.gen.prompt_of(choice)
        if self.req.echo:
            text = self.state.tokenizer.decode(prompt) + text
            if lp is not None and st.prompt is not None:
                lp = _echo_logprobs(self.state.tokenizer, prompt, st.prompt, self.req.logprobs, lp)
        body = {"index": st.index, "text": text, "logprobs": lp, "finish_reason": st.finish_reason}
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = _vllm_prompt_logprobs(self.state.tokenizer, prompt, st.prompt,
                                                            self.req.prompt_logprobs)
        return body

    # ---- streamed ------------------------------------------------------------------------------------
    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        if self.chat:
            for c in self.gen.choices:
                await self._send(resp, self._chunk(c, {"role": "assistant", "content": ""}, None))
        try:
            async with aclosing(self.gen.events()) as events:
                async for event in events:
                    if event.error is not None:  # after the 200: one error event, then [DONE]
                        await self._send(resp, event.error.body())
                        return await self._end(resp)
                    await self._send_event(resp, event)
                    choice = event.choice
                    if event.last and choice.state.finish_reason == "error" and choice.state.error:  # after some tokens
                        await self._send(resp, engine_error(choice.state.error, choice.state.error_code).body())
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

    async def _send_event(self, resp, event: ChoiceEvent) -> None:
        """The chunks of one engine event: chat deltas (reasoning, content, tool-call pieces), or
        completions text; the new tokens' logprobs ride on the first, the finish_reason on the
        last, once."""
        choice, st = event.choice, event.choice.state
        start = self.sent_tokens.get(st.index, 0)
        lp = self._logprobs(choice, start) if self.req.logprobs is not None else None
        new_tokens = len(st.token_ids) - start
        self.sent_tokens[st.index] = len(st.token_ids)
        if self.chat:
            deltas = [chat_delta(e) for e in self._chat_events(event)]
            deltas = [d for d in deltas if d]
        else:
            deltas = [event.text] if event.text else []
        finish = self._finish_reason(choice) if event.last else None
        if not deltas and (new_tokens or finish is not None):
            deltas = [{} if self.chat else ""]  # the logprobs or the finish_reason still go out
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            chunk = self._chunk(choice, delta, finish if last else None, lp if i == 0 else None)
            if self.req.continuous_usage:  # running totals, so clients can count tokens per chunk exactly
                chunk["usage"] = self._usage()
            await self._send(resp, chunk)

    def _chunk(self, choice: ChoiceStream, delta: dict | str, finish: str | None, lp: Any = None) -> dict:
        if not self.chat:
            body = {"index": choice.state.index, "text": delta, "logprobs": lp, "finish_reason": finish}
            return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.req.model,
                    "choices": [body]}
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.req.model,
                "choices": [{"index": choice.state.index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

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


def openai_message(message: dict) -> dict:
    """A chat message in OpenAI's shape: content (None when only tools were called), the
    reasoning (`reasoning_content`, and vLLM's newer `reasoning` alias), the tool calls."""
    reasoning = message.get("reasoning_content") or None  # chat mode, or no reasoning written: null, as vLLM
    out = {"role": "assistant", "content": message.get("content") or (None if message.get("tool_calls") else ""),
           "reasoning_content": reasoning, "reasoning": reasoning}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [{"id": c["id"], "type": "function", "function": c["function"]} for c in calls]
    return out


def chat_delta(event) -> dict | None:
    """One output event as a chat-completion chunk's delta."""
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text, "reasoning": event.text} if event.text else None
    if isinstance(event, ContentDelta):
        return {"content": event.text} if event.text else None
    if isinstance(event, ToolCallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    if isinstance(event, ToolCallArgumentsDelta):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]}
    return None  # MessageDone: its message is the response's, not a delta


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
