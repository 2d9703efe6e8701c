"""The edge validator (ipc/prompt_checks.py) and the entry points that use it: the HTTP handlers
(server/handlers.py), the offline API (server/llm.py `validate_request`) and the engine's
`add_request` (what the worker and `generate` call). Each entry refuses exactly the inputs the
others refuse, at the same boundaries, naming the same numbers in its own wording.

The reference is the arithmetic written out here: a prompt of n tokens with max_tokens m fits a
context of L tokens iff 1 ≤ n and n + m ≤ L, and every id is in [0, V).
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from ipc.messages import SamplingParams
from ipc.prompt_checks import (ContextExceeded, EmptyPrompt, PromptRefused, TokenOutsideVocabulary, check_context,
                               check_prompt, check_token_ids)
from server import handlers
from server.errors import ProtocolError
from server.llm import validate_request
from server.protocol import Limits, parse_completion

VOCAB, LIMIT = 100, 64
CASES = [  # (prompt, max_tokens)
    ([5] * 54, 10), ([5] * 55, 10), ([5] * 63, 1), ([5] * 64, 1), ([5] * 1, 64), ([5] * 1, 63),
    ([5, 99, 7], 4), ([5, 100, 7], 4), ([5, 10**6], 4), ([0], 1),
]


def _fits(prompt: list[int], max_tokens: int) -> str | None:
    """What is wrong with the request, by the arithmetic above (None: it fits)."""
    if not prompt:
        return "empty"
    if any(not 0 <= t < VOCAB for t in prompt):
        return "token"
    return "context" if len(prompt) + max_tokens > LIMIT else None


def test_the_validator_draws_the_boundaries_the_arithmetic_does():
    for prompt, max_tokens in CASES + [([], 1)]:
        want = _fits(prompt, max_tokens)
        if want is None:
            check_prompt(prompt, max_tokens, vocab_size=VOCAB, max_model_len=LIMIT)
            continue
        kind = {"empty": EmptyPrompt, "token": TokenOutsideVocabulary, "context": ContextExceeded}[want]
        with pytest.raises(kind):
            check_prompt(prompt, max_tokens, vocab_size=VOCAB, max_model_len=LIMIT)
    with pytest.raises(TokenOutsideVocabulary, match=r"token id -1 is outside the vocabulary \[0, 100\)"):
        check_token_ids([3, -1, 500], VOCAB)  # the first bad id is named
    check_context(LIMIT - 1, None, LIMIT)  # max_tokens left to the server: one token must fit
    with pytest.raises(ContextExceeded, match="the prompt has 64 tokens; the model's context length is 64 tokens"):
        check_context(LIMIT, None, LIMIT)
    exc = ContextExceeded(60, 10, LIMIT)
    assert str(exc) == "prompt (60 tokens) plus max_tokens (10) exceeds the model's context length (64 tokens)"
    assert isinstance(exc, PromptRefused) and isinstance(exc, ValueError)


def _http(prompt: list[int], max_tokens: int) -> ProtocolError | None:
    """The completions handler's checks of a token-id prompt (before anything reaches an engine)."""
    state = SimpleNamespace(vocab_size=VOCAB, max_model_len=LIMIT, tokenizer=None)
    req = parse_completion({"model": "m", "prompt": prompt, "max_tokens": max_tokens}, Limits(), ["m"])
    try:
        prompts = asyncio.run(handlers._completion_prompts(state, req))
        handlers._fit_context(state, req, prompts)
    except ProtocolError as exc:
        return exc
    return None


def _offline(prompt: list[int], max_tokens: int) -> ValueError | None:
    try:
        validate_request(VOCAB, LIMIT, prompt, SamplingParams(max_tokens=max_tokens), 0)
    except ValueError as exc:
        return exc
    return None


@pytest.mark.parametrize("prompt, max_tokens", CASES)
def test_http_and_offline_refuse_the_same_requests(prompt, max_tokens):
    want = _fits(prompt, max_tokens)
    http, offline = _http(prompt, max_tokens), _offline(prompt, max_tokens)
    assert (http is None, offline is None) == (want is None, want is None), (http, offline)
    if want == "token":
        bad = next(t for t in prompt if not 0 <= t < VOCAB)
        assert http.status == 400 and http.param == "prompt" and http.code == "invalid_value"
        assert http.message == f"token id {bad} in 'prompt' is outside the vocabulary [0, {VOCAB})"
        assert str(offline) == f"prompt 0: token id {bad} is outside the vocabulary [0, {VOCAB})"
    elif want == "context":
        n = len(prompt)
        assert http.status == 400 and http.code == "context_length_exceeded"
        if n >= LIMIT:  # the prompt alone fills the context
            assert http.param == "prompt" and http.message == f"the prompt has {n} tokens; the model's context " \
                                                              f"length is {LIMIT} tokens"
        else:
            assert http.param == "max_tokens" and http.message == (
                f"this model's maximum context length is {LIMIT} tokens, but the request asks for {n + max_tokens} "
                f"tokens ({n} in the prompt plus {max_tokens} for the completion)")
        assert str(offline) == (f"prompt 0: {n} prompt tokens plus max_tokens {max_tokens} exceed the model's "
                                f"context length ({LIMIT} tokens)")


def test_the_offline_api_names_an_empty_prompt():
    assert str(_offline([], 4)) == "prompt 0 is empty"
