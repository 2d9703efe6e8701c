"""The offline Python API in the style of vLLM's `LLM`: prompts in, completions out, through the
same asyncio worker that serves online traffic (run in-process here).

    from server.llm import LLM, SamplingParams
    llm = LLM("path/to/model", max_num_seqs=32)
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=16))
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from engine.engine import Engine, EngineConfig, TokenDelta, default_dtype
from engine.sampling import SamplingParams
from engine.weights import load_model
from engine.worker import Worker, new_event_loop

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class LLM:
    def __init__(self, model: str | Path | None = None, device: str = "cpu", **engine_args):
        from server.builtin import builtin_model_dir
        from server.tokenizer import Tokenizer

        model_dir = Path(model) if model is not None else builtin_model_dir()
        config = EngineConfig(**engine_args)
        self.model = load_model(model_dir, dtype=default_dtype(config, device), device=device,
                                progress=False, load_mtp=bool(config.resolved().speculative_tokens))
        self.engine = Engine(self.model, config)
        self.tokenizer = Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").exists() else None
        self._next_id = 0

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: list[str | list[int]], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt concurrently through the engine; outputs in input order."""
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("one SamplingParams per prompt")
        outputs = []
        for prompt, p in zip(prompts, params_list):
            out = RequestOutput(f"offline-{self._next_id}", self._encode(prompt))
            out.logprobs = [] if p.logprobs is not None else None
            out.top_logprobs = [] if p.logprobs is not None else None
            outputs.append(out)
            self._next_id += 1
        loop = new_event_loop()
        try:
            loop.run_until_complete(self._run(outputs, params_list))
        finally:
            loop.close()
        if self.tokenizer is not None:
            for out in outputs:
                out.text = self.tokenizer.decode(out.token_ids)
        return outputs

    async def _run(self, outputs: list[RequestOutput], params: list[SamplingParams]) -> None:
        if not outputs:
            return
        by_id = {o.request_id: o for o in outputs}
        remaining = set(by_id)
        done = asyncio.Event()

        def emit(delta: TokenDelta) -> None:
            out = by_id[delta.request_id]
            out.token_ids.extend(delta.token_ids)
            if delta.logprobs is not None:
                out.logprobs.extend(delta.logprobs)
                out.top_logprobs.extend(delta.top_logprobs or [])
            if delta.finish_reason is not None:
                out.finish_reason, out.error = delta.finish_reason, delta.error
                remaining.discard(delta.request_id)
                if not remaining:
                    done.set()
                    worker.stop()

        worker = Worker(self.engine, emit)
        try:
            for out, p in zip(outputs, params):
                worker.submit(out.request_id, out.prompt_token_ids, p)
            await worker.run()
        finally:
            worker.close()
        await done.wait()
