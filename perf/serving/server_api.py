"""Side endpoints of the server under test: models, /tokenize, /detokenize, Prometheus /metrics.

/tokenize and /detokenize follow vLLM's shape: POST /tokenize {"model", "prompt",
"add_special_tokens"} → {"tokens": [...], "count": n}; POST /detokenize {"model", "tokens"} →
{"prompt": text}. llama.cpp's llama-server names the text "content" on both (and "add_special"),
so both names are sent and read. Every helper returns None when the endpoint is missing or fails.
"""

from __future__ import annotations

import re
from typing import Any

import aiohttp

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = list[tuple[str, dict[str, str], float]]


def _root(base_url: str) -> str:
    return base_url.rstrip("/")


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
    try:
        async with http.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                return None
            return await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def first_model(http: aiohttp.ClientSession, base_url: str,
                      headers: dict[str, str]) -> tuple[str, int | None] | None:
    """(id, max_model_len if listed) of the first model in /v1/models."""
    try:
        async with http.get(_root(base_url) + "/v1/models", headers=headers) as resp:
            if resp.status != 200:
                return None
            data = await resp.json(content_type=None)
        entry = data["data"][0]
        mml = entry.get("max_model_len")
        return str(entry["id"]), (int(mml) if isinstance(mml, int) else None)
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
        return None


async def tokenize(http: aiohttp.ClientSession, base_url: str, model: str, text: str,
                   headers: dict[str, str]) -> list[int] | None:
    """Token ids of `text` without special tokens, or None."""
    data = await _post(http, _root(base_url) + "/tokenize",
                       {"model": model, "prompt": text, "content": text, "add_special_tokens": False,
                        "add_special": False}, headers)
    tokens = data.get("tokens") if isinstance(data, dict) else None
    return [int(t) for t in tokens] if isinstance(tokens, list) else None


async def detokenize(http: aiohttp.ClientSession, base_url: str, model: str, tokens: list[int],
                     headers: dict[str, str]) -> str | None:
    """Text of `tokens`, or None."""
    data = await _post(http, _root(base_url) + "/detokenize", {"model": model, "tokens": tokens}, headers)
    text = data.get("prompt", data.get("content")) if isinstance(data, dict) else None
    return text if isinstance(text, str) else None


async def scrape(http: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> Samples | None:
    """All samples of GET /metrics (Prometheus text format), or None when unavailable."""
    try:
        async with http.get(_root(base_url) + "/metrics", headers=headers) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    return parse_prometheus(text)


def parse_prometheus(text: str) -> Samples:
    """(name, labels, value) for every sample line; comments and malformed lines are skipped."""
    out: Samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line.strip())
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.append((m.group(1), labels, value))
    return out
