"""The edge validator: does a prompt fit this model (its token ids, its context length)?

One definition for every place a request enters: the HTTP handlers (server/handlers.py), the
offline `LLM` (server/llm.py), the engine's `add_request` (what the worker and `generate`
call; engine/engine.py) and a PD decode leg's first token (engine/kv_transfer/decode_side.py).
Past these, the scheduler only asserts. No torch: the front process runs it.

Each refusal is a `PromptRefused` carrying the numbers; its message is the engine's wording,
and a surface with its own (OpenAI's "maximum context length", the offline API's "prompt i:")
formats from the fields.
"""
from __future__ import annotations

from collections.abc import Iterable


class PromptRefused(ValueError):
    """A prompt this model cannot serve."""


class EmptyPrompt(PromptRefused):
    def __init__(self) -> None:
        super().__init__("the prompt is empty")


class TokenOutsideVocabulary(PromptRefused):
    def __init__(self, token_id: int, vocab_size: int):
        super().__init__(f"token id {token_id} is outside the vocabulary [0, {vocab_size})")
        self.token_id, self.vocab_size = token_id, vocab_size


class ContextExceeded(PromptRefused):
    """`max_tokens` None: the request left it to the server (the rest of the context), and the
    prompt alone leaves no room for one generated token."""

    def __init__(self, prompt_tokens: int, max_tokens: int | None, max_model_len: int):
        if max_tokens is None:
            message = f"the prompt has {prompt_tokens} tokens; the model's context length is {max_model_len} tokens"
        else:
            message = (f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
                       f"context length ({max_model_len} tokens)")
        super().__init__(message)
        self.prompt_tokens, self.max_tokens, self.max_model_len = prompt_tokens, max_tokens, max_model_len


def check_token_ids(token_ids: Iterable[int], vocab_size: int) -> None:
    """TokenOutsideVocabulary for the first id not in [0, vocab_size)."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise TokenOutsideVocabulary(bad, vocab_size)


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """ContextExceeded unless the prompt plus `max_tokens` generated tokens fit the context
    (`max_tokens` None: unless at least one token fits after the prompt)."""
    if prompt_tokens + (1 if max_tokens is None else max_tokens) > max_model_len:
        raise ContextExceeded(prompt_tokens, max_tokens, max_model_len)


def check_prompt(token_ids: list[int], max_tokens: int, *, vocab_size: int, max_model_len: int) -> None:
    """A whole request's prompt: not empty, every id in the vocabulary, prompt plus
    `max_tokens` within the context. The first failure, as a PromptRefused."""
    if not token_ids:
        raise EmptyPrompt()
    check_token_ids(token_ids, vocab_size)
    check_context(len(token_ids), max_tokens, max_model_len)
