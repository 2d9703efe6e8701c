"""A minimal transformers-based OpenAI-compatible server: the baseline ringserve is compared to.

    python perf/peer_server.py MODEL_DIR --port 8001 [--dtype fp32|bf16] [--threads N]

Serves a Hugging Face directory with `DeepseekV4ForCausalLM` (any causal LM works) on
/v1/chat/completions and /v1/completions (streaming SSE with `stream_options.include_usage` and
vLLM's `continuous_usage_stats`, or one JSON response), /v1/models, /tokenize, /detokenize and
/health. Requests run one at a time on a single generation thread (a queue, no batching): each
is a prefill then one forward per token with transformers' KV cache. Extensions: `ignore_eos`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

_DONE = object()


@dataclass(slots=True)
class GenParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False


class Generator:
    """The model and tokenizer; `generate` runs on the generation thread only."""

    def __init__(self, model_dir: str, dtype: str) -> None:
        import torch
        import transformers

        self.torch = torch
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        cls = getattr(transformers, "DeepseekV4ForCausalLM", transformers.AutoModelForCausalLM)
        self.model = cls.from_pretrained(model_dir, dtype=torch_dtype).eval()
        cfg = self.model.config
        self.max_model_len = int(getattr(cfg, "max_position_embeddings", 4096))
        eos = getattr(self.model.generation_config, "eos_token_id", None) or cfg.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}

    def generate(self, ids: list[int], p: GenParams, emit, cancel: threading.Event) -> str:
        """Emit token ids one by one; returns the finish reason."""
        torch = self.torch
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        with torch.inference_mode():
            x = torch.tensor([ids])
            past = None
            for _ in range(p.max_tokens):
                if cancel.is_set():
                    return "abort"
                out = self.model(x, past_key_values=past, use_cache=True)
                past = out.past_key_values
                tok = self._sample(out.logits[0, -1].float(), p, gen)
                emit(tok)
                if tok in self.eos_ids and not p.ignore_eos:
                    return "stop"
                x = torch.tensor([[tok]])
        return "length"

    def _sample(self, logits, p: GenParams, gen) -> int:
        torch = self.torch
        if p.temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sp, si = probs.sort(descending=True)
            keep = sp.cumsum(0) - sp < p.top_p
            probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
        return int(torch.multinomial(probs, 1, generator=gen))


class Detok:
    """Incremental detokenization: emits text only at complete UTF-8 characters."""

    def __init__(self, tokenizer) -> None:
        self.tok, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def push(self, tid: int) -> str:
        self.ids.append(tid)
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        now = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before):]


class Server:
    """aiohttp handlers around one Generator and one generation thread."""

    def __init__(self, gen: Generator, name: str) -> None:
        self.gen, self.name = gen, name
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peer-gen")

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/health", self.health), web.get("/v1/models", self.models),
                web.post("/v1/chat/completions", self.chat), web.post("/v1/completions", self.completions),
                web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize)]

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.name, "object": "model", "owned_by": "peer", "max_model_len": self.gen.max_model_len}]})

    async def tokenize(self, req: web.Request) -> web.Response:
        body = await req.json()
        if "messages" in body:
            ids = self._chat_ids(body["messages"])
        else:
            ids = self.gen.tokenizer.encode(body.get("prompt", ""), add_special_tokens=body.get("add_special_tokens", True))
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": self.gen.max_model_len})

    async def detokenize(self, req: web.Request) -> web.Response:
        body = await req.json()
        return web.json_response({"prompt": self.gen.tokenizer.decode(body.get("tokens", []))})

    def _chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        out = self.gen.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
        return list(out)

    async def chat(self, req: web.Request) -> web.StreamResponse:
        return await self._serve(req, chat=True)

    async def completions(self, req: web.Request) -> web.StreamResponse:
        return await self._serve(req, chat=False)

    async def _serve(self, req: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await req.json()
            ids = self._chat_ids(body["messages"]) if chat else self.gen.tokenizer.encode(body["prompt"])
            p = GenParams(int(body.get("max_completion_tokens") or body.get("max_tokens") or 16),
                          float(body.get("temperature", 1.0)), float(body.get("top_p", 1.0)), body.get("seed"),
                          bool(body.get("ignore_eos", False)))
        except (ValueError, KeyError, TypeError) as exc:
            return _error(400, f"bad request: {exc}")
        if len(ids) + p.max_tokens > self.gen.max_model_len:
            return _error(400, f"prompt ({len(ids)}) + max_tokens ({p.max_tokens}) exceeds {self.gen.max_model_len}")
        if body.get("stream"):
            return await self._stream(req, body, ids, p, chat)
        return await self._whole(body, ids, p, chat)

    async def _tokens(self, ids: list[int], p: GenParams, cancel: threading.Event):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        fut = loop.run_in_executor(self.pool, self.gen.generate, ids, p,
                                   lambda t: loop.call_soon_threadsafe(q.put_nowait, t), cancel)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(q.put_nowait, _DONE))
        while (item := await q.get()) is not _DONE:
            yield item
        yield await fut

    async def _stream(self, req: web.Request, body: dict, ids: list[int], p: GenParams, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(req)
        opts = body.get("stream_options") or {}
        rid, created, n = f"peer-{uuid.uuid4().hex[:12]}", int(time.time()), 0
        detok, cancel = Detok(self.gen.tokenizer), threading.Event()

        def chunk(text: str | None, finish: str | None, usage: bool) -> dict:
            choice = ({"index": 0, "delta": {"content": text} if text is not None else {}, "finish_reason": finish}
                      if chat else {"index": 0, "text": text or "", "finish_reason": finish})
            d = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                 "model": self.name, "choices": [choice]}
            if usage:
                d["usage"] = _usage(len(ids), n)
            return d

        try:
            async for item in self._tokens(ids, p, cancel):
                if isinstance(item, str):
                    await _send(resp, chunk(None, item, bool(opts.get("continuous_usage_stats"))))
                    break
                n += 1
                await _send(resp, chunk(detok.push(item), None, bool(opts.get("continuous_usage_stats"))))
            if opts.get("include_usage"):
                await _send(resp, {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                   "created": created, "model": self.name, "choices": [], "usage": _usage(len(ids), n)})
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            cancel.set()
            raise
        return resp

    async def _whole(self, body: dict, ids: list[int], p: GenParams, chat: bool) -> web.Response:
        out: list[int] = []
        finish = "length"
        async for item in self._tokens(ids, p, threading.Event()):
            if isinstance(item, str):
                finish = item
            else:
                out.append(item)
        text = self.gen.tokenizer.decode(out, skip_special_tokens=True)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                  if chat else {"index": 0, "text": text, "finish_reason": finish})
        return web.json_response({"id": f"peer-{uuid.uuid4().hex[:12]}", "object": "chat.completion" if chat
                                  else "text_completion", "created": int(time.time()), "model": self.name,
                                  "choices": [choice], "usage": _usage(len(ids), len(out))})


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _send(resp: web.StreamResponse, data: dict) -> None:
    await resp.write(b"data: " + json.dumps(data).encode() + b"\n\n")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=status)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--served-model-name", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        from perf.machine import set_cpu_threads

        set_cpu_threads(args.threads)
    server = Server(Generator(args.model_dir, args.dtype), args.served_model_name or Path(args.model_dir).name)
    app = web.Application()
    app.add_routes(server.routes())
    print(f"peer server: {server.name} on http://{args.host}:{args.port}", flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
