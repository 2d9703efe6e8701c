"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

The request asks for `stream_options.include_usage` (final token counts) and, unless disabled,
`continuous_usage_stats` (vLLM's per-chunk usage, which gives exact tokens per chunk). A chunk
is token-carrying when its per-chunk usage grew, it carries logprobs, or it has output text:
`delta.content`, the reasoning (`delta.reasoning_content`, else vLLM's `delta.reasoning`: a
server that sends both sends the same text), a tool call's name or arguments, or completions
`text` — so TTFT counts the first reasoning, content or tool-call token, as AIPerf does. Its token count comes from,
in order: the per-chunk usage delta, the number of logprob entries, else 1 (inexact; see
`metrics.apportion`). Per-chunk usage is trusted once a chunk with text carries it, so a server
that puts the final usage on its finish chunk is not mistaken for one N-token chunk. A stream
that ends without `[DONE]` still succeeds if it carried tokens (some servers omit `[DONE]`).
The usage's `prompt_tokens_details.cached_tokens` and `completion_tokens_details.reasoning_tokens`
are kept when present (the last usage seen wins, as for the token totals).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from perf.serving.records import RequestRecord, RequestSpec


@dataclass(slots=True)
class ApiConfig:
    """Where and how to send requests."""

    base_url: str
    model: str
    endpoint: str = "chat"  # chat | completions
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    continuous_usage: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


def build_payload(api: ApiConfig, spec: RequestSpec) -> dict[str, Any]:
    """The JSON body for `spec` (`ignore_eos` is a vLLM/ringserve extension field)."""
    body: dict[str, Any] = {
        "model": api.model,
        spec.max_tokens_field: spec.max_tokens,
        "temperature": api.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if api.continuous_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    if api.endpoint == "chat":
        body["messages"] = spec.messages if spec.messages is not None else [{"role": "user", "content": spec.prompt}]
    elif spec.messages is not None:
        raise ValueError("a chat history needs the chat endpoint")
    else:
        body["prompt"] = spec.prompt
    if api.ignore_eos:
        body["ignore_eos"] = True
    body.update(api.extra_body)
    body.update(spec.extra_body)
    return body


class _ChunkCounter:
    """Turns parsed SSE chunks into (token count, exact?) and final usage."""

    def __init__(self) -> None:
        self.last_completion = 0
        self.continuous = False  # per-chunk usage seen on a chunk with text
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.reasoning_tokens: int | None = None

    def feed(self, data: dict[str, Any]) -> tuple[int, bool]:
        usage = data.get("usage") or None
        choices = data.get("choices") or []
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
            self.cached_tokens = _detail(usage, "prompt_tokens_details", "cached_tokens", self.cached_tokens)
            self.reasoning_tokens = _detail(usage, "completion_tokens_details", "reasoning_tokens",
                                            self.reasoning_tokens)
        if not choices:
            return 0, True
        choice = choices[0]
        text = _text_of(choice)
        if usage and "completion_tokens" in usage and (self.continuous or text):
            self.continuous = True
            delta = int(usage["completion_tokens"]) - self.last_completion
            self.last_completion = int(usage["completion_tokens"])
            return max(0, delta), True
        n_lp = _logprob_count(choice)
        if n_lp:
            return n_lp, True
        return (1, False) if text else (0, True)


def _detail(usage: dict[str, Any], group: str, key: str, default: int | None) -> int | None:
    details = usage.get(group)
    value = details.get(key) if isinstance(details, dict) else None
    return int(value) if isinstance(value, int) else default


def _text_of(choice: dict[str, Any]) -> str:
    """The output text a chunk carries: content, reasoning, tool-call names and arguments."""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return choice.get("text") or ""
    parts = [delta.get("content") or "", delta.get("reasoning_content") or delta.get("reasoning") or ""]
    for call in delta.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            parts += [fn.get("name") or "", fn.get("arguments") or ""]
    return "".join(p for p in parts if isinstance(p, str))


def _logprob_count(choice: dict[str, Any]) -> int:
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return 0
    if isinstance(lp.get("content"), list):
        return len(lp["content"])
    if isinstance(lp.get("tokens"), list):
        return len(lp["tokens"])
    return 0


async def send(http: aiohttp.ClientSession, api: ApiConfig, rec: RequestRecord) -> RequestRecord:
    """Stream `rec.spec`, filling `rec` in place; never raises for HTTP or stream errors."""
    counter = _ChunkCounter()
    rec.send_s = time.perf_counter()
    try:
        headers = {**api.headers(), **rec.spec.headers}
        async with http.post(api.url, json=build_payload(api, rec.spec), headers=headers) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            done = await _read_stream(resp, rec, counter)
        rec.ok = done or rec.first_token_s is not None
        if not rec.ok:
            rec.error = "stream ended without data"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        rec.end_s = time.perf_counter()
        rec.prompt_tokens = counter.prompt_tokens
        rec.completion_tokens = counter.completion_tokens
        rec.cached_tokens = counter.cached_tokens
        rec.reasoning_tokens = counter.reasoning_tokens
    return rec


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord, counter: _ChunkCounter) -> bool:
    """Consume SSE lines; True when `[DONE]` arrived. Raises ValueError on a server error event."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return True
        now = time.perf_counter()
        data = json.loads(payload)
        if "error" in data and not data.get("choices"):
            raise ValueError(f"server error event: {str(data['error'])[:200]}")
        k, exact = counter.feed(data)
        if k <= 0:
            continue
        if rec.first_token_s is None:
            rec.first_token_s = now
        rec.chunk_times.append(now)
        rec.chunk_tokens.append(k)
        rec.chunk_tokens_exact &= exact
    return False
