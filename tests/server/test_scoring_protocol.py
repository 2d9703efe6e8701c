"""Parsing of the scoring fields of /v1/completions: `max_tokens: 0`, `echo` with `logprobs`, and
vLLM's `prompt_logprobs` (what reaches the engine's SamplingParams, and what is refused)."""

from __future__ import annotations

import pytest

from server.protocol import Limits, ProtocolError, parse_chat, parse_completion

SERVED = ["m"]


def _completion(**body):
    return parse_completion({"prompt": "some text", **body}, Limits(), SERVED)


def test_max_tokens_0_scores_only_and_the_engine_still_samples_one():
    req = _completion(max_tokens=0, echo=True, logprobs=2)
    assert req.score_only and req.max_tokens_given
    assert req.params.max_tokens == 1 and req.params.prompt_logprobs == 2 and req.params.logprobs == 2


def test_prompt_logprobs_only_when_asked():
    assert _completion(max_tokens=3, logprobs=1).params.prompt_logprobs is None  # no echo: completion only
    assert _completion(max_tokens=3, echo=True).params.prompt_logprobs is None  # echo without logprobs
    req = _completion(max_tokens=3, prompt_logprobs=4)
    assert req.params.prompt_logprobs == 4 and req.prompt_logprobs == 4 and not req.score_only
    assert _completion(echo=True, logprobs=1, prompt_logprobs=5).params.prompt_logprobs == 5  # the larger


@pytest.mark.parametrize("body, param", [
    ({"prompt_logprobs": Limits().max_logprobs + 1}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0, "stream": True}, "max_tokens"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_bad_scoring_requests_name_the_field(body, param):
    with pytest.raises(ProtocolError) as err:
        _completion(**body)
    assert err.value.param == param and err.value.status == 400


def test_chat_keeps_its_minimum_and_refuses_prompt_logprobs():
    msgs = [{"role": "user", "content": "hi"}]
    for body, param in (({"max_tokens": 0}, "max_tokens"), ({"prompt_logprobs": 1}, "prompt_logprobs")):
        with pytest.raises(ProtocolError) as err:
            parse_chat({"messages": msgs, **body}, Limits(), SERVED)
        assert err.value.param == param
