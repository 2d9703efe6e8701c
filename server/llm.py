"""The offline Python API in the style of vLLM's `LLM`: prompts in, completions out, through the
same engine client and worker processes that serve online traffic.

    from server.llm import LLM, SamplingParams
    with LLM("path/to/model", max_num_seqs=32) as llm:
        outputs = llm.generate(["Hello"], SamplingParams(max_tokens=16))
        # DeepSeek-V4.1 with its vision tower: vLLM's prompt dicts (server/image_prompts.py)
        outputs = llm.generate({"prompt": "Describe <｜deepseek_image｜>.", "multi_modal_data": {"image": img}})

The client's event loop runs on a background thread for the LLM's lifetime (its listeners keep
draining the workers' output rings between calls); `close()` (or leaving the `with` block, or
interpreter exit) stops the workers and removes their rings.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import EngineConfig, ParallelConfig
from ipc.codec import InvalidField, check
from ipc.loop import new_event_loop
from ipc.messages import SamplingParams
from ipc.prompt_checks import ContextExceeded, EmptyPrompt, PromptRefused, check_prompt

from .engine_client import EngineClient
from .image_prompts import ImagePrompts, images_of
from .stream import ChoiceState, collect

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


@dataclass
class RequestOutput:
    request_index: int
    prompt_token_ids: list[int]  # with images: their spans expanded
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class LLM:
    def __init__(self, model: str | Path | None = None, dp: int = 1, device: str = "cpu",
                 threads_per_worker: int | None = None, parallel: ParallelConfig | None = None,
                 limit_mm_per_prompt: dict | None = None, **engine_args):
        """`dp` ranks replicate the model; for expert parallelism pass a ParallelConfig
        (`ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)`), as the CLI does.
        `limit_mm_per_prompt`: vLLM's {"image": N} (images per prompt)."""
        from server.builtin import builtin_model_dir
        from server.tokenizer import Tokenizer

        self.model_dir = Path(model) if model is not None else builtin_model_dir()
        from engine.config import ModelConfig

        self.model_config = ModelConfig.from_model_dir(self.model_dir)
        self.config = EngineConfig(**engine_args).resolved()
        has_tokenizer = (self.model_dir / "tokenizer.json").exists()
        self.tokenizer = Tokenizer.from_dir(self.model_dir) if has_tokenizer else None
        limit = (limit_mm_per_prompt or {}).get("image")
        self.images = ImagePrompts(self.model_config, getattr(self.config, "language_model_only", False), limit)
        self.client = EngineClient(self.model_dir, self.config, device=device, threads_per_worker=threads_per_worker,
                                   parallel=parallel or ParallelConfig(data_parallel_size=dp),
                                   image_bytes=self.images.submit_bytes)
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ringserve-llm", daemon=True)
        self._thread.start()
        self._closed = False
        self._finalizer = weakref.finalize(self, LLM._shutdown, self.client, self._loop, self._thread)
        atexit.register(self._finalizer)
        try:
            self._call(self.client.start())
        except BaseException:
            self._closed = True
            self._finalizer()  # workers that did start are stopped, their rings unlinked
            raise

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    def _call(self, coro):
        """Run `coro` on the client's loop and wait; an interrupt (Ctrl-C) cancels it there."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt concurrently; outputs in input order. A prompt is text, token ids, or
        vLLM's dict ({"prompt": text} or {"prompt_token_ids": ids}, with "multi_modal_data":
        {"image": one or a list of PIL images, bytes or paths}); one prompt alone may be given
        without a list. Invalid input raises ValueError naming the prompt and the field, before
        anything is sent to a worker."""
        if self._closed:
            raise RuntimeError("this LLM is closed")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                  and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("one SamplingParams per prompt")
        prepared = [self._prepare(p, i) for i, p in enumerate(prompts)]
        ids = [p[0] for p in prepared]
        for i, (prompt, p) in enumerate(zip(ids, params_list)):
            self.validate(prompt, p, i)
        states = self._call(self._run(prepared, params_list)) if ids else []
        return [self._output(i, prompt, st, p) for i, (prompt, st, p) in enumerate(zip(ids, states, params_list))]

    def _prepare(self, prompt, index: int) -> tuple[list[int], list]:
        """(prompt ids with image spans expanded, the prompt's ImageData)."""
        if not isinstance(prompt, dict):
            return self.encode(prompt), []
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError(f"prompt {index}: a prompt dict has 'prompt' or 'prompt_token_ids' (one of them) and "
                             "optionally 'multi_modal_data'")
        ids = self.encode(prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"])
        images = images_of(prompt.get("multi_modal_data"), index)
        return self.images.expand(ids, images, index)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, index: int = 0) -> None:
        validate_request(self.model_config.vocab_size, self.max_model_len, prompt_token_ids, params, index)

    async def _run(self, prompts: list[tuple[list[int], list]], params: list[SamplingParams]) -> list[ChoiceState]:
        return await asyncio.gather(*(collect(self.client, ids, p, self.tokenizer, i, images=images)
                                      for i, ((ids, images), p) in enumerate(zip(prompts, params))))

    def _output(self, index: int, prompt: list[int], st: ChoiceState, params: SamplingParams) -> RequestOutput:
        with_lp = params.logprobs is not None
        return RequestOutput(index, prompt, st.token_ids, st.text if self.tokenizer is not None else None,
                             st.finish_reason, st.error, st.logprobs if with_lp else None,
                             st.top_logprobs if with_lp else None)

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _shutdown(client: EngineClient, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
        if loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(LLM._stop_everything(client), loop).result(timeout=30)
        except Exception:  # noqa: BLE001 - best effort at exit; the workers are daemons either way
            logging.getLogger(__name__).warning("LLM shutdown did not complete cleanly")
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        if not loop.is_running():
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    @staticmethod
    async def _stop_everything(client: EngineClient) -> None:
        """The workers stopped, then every task still on the loop (a generate cut short by Ctrl-C)
        cancelled and awaited, as asyncio.run does: a task left pending when the loop closes
        prints 'Event loop is closed' tracebacks when it is collected."""
        await client.shutdown(timeout_s=5.0)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def validate_request(vocab_size: int, max_model_len: int, prompt_token_ids: list[int], params: SamplingParams,
                     index: int = 0) -> None:
    """The edge checks of one offline request (ValueError naming the prompt and the field):
    sampling parameters against their wire types, token ids against the vocabulary, prompt plus
    max_tokens against the context."""
    try:
        check(params)
    except InvalidField as exc:
        raise ValueError(f"prompt {index}: {exc.field}: {exc.reason}") from None
    try:
        check_prompt(prompt_token_ids, params.max_tokens, vocab_size=vocab_size, max_model_len=max_model_len)
    except EmptyPrompt:
        raise ValueError(f"prompt {index} is empty") from None
    except ContextExceeded as exc:
        raise ValueError(f"prompt {index}: {exc.prompt_tokens} prompt tokens plus max_tokens {exc.max_tokens} "
                         f"exceed the model's context length ({exc.max_model_len} tokens)") from None
    except PromptRefused as exc:  # a token id outside the vocabulary
        raise ValueError(f"prompt {index}: {exc}") from None
