"""Scoring through the API, as evaluation harnesses use it, checked against transformers'
DeepseekV4ForCausalLM on the same weights: completions `echo` + `logprobs` with `max_tokens: 0`
(lm-evaluation-harness's loglikelihood path) and vLLM's `prompt_logprobs`, with a prefill split
into chunks so prompt rows from several engine steps are joined."""

from __future__ import annotations

import math

import openai
import pytest
import torch

from perf.score_api import score_text
from server_process import Server

transformers = pytest.importorskip("transformers")

TEXT = ("The function returns a list of the values, and each argument is checked before the object is "
        "created by the module.")


@pytest.fixture(scope="module")
def chunked_server(model_dir):
    s = Server(model_dir, "--max-num-seqs", "2", "--max-num-batched-tokens", "8", "--dtype", "fp32")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(chunked_server):
    return openai.OpenAI(base_url=chunked_server.url + "/v1", api_key=chunked_server.api_key, max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def reference(model_dir):
    """(prompt ids, log p(token i | tokens < i) for i ≥ 1, argmax ids) by transformers in fp32."""
    from server.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(model_dir).encode(TEXT)
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)  # [P, V]
    target = torch.tensor(ids[1:])
    return ids, logp[:-1].gather(1, target[:, None]).squeeze(1), logp[:-1].argmax(-1)


def test_echo_logprobs_with_max_tokens_0_score_the_prompt(client, reference):
    ids, want, argmax = reference
    assert len(ids) > 8 * 2  # the prefill runs in several chunks of 8
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=TEXT, echo=True, logprobs=1, max_tokens=0, temperature=0)
    choice = out.choices[0]
    assert choice.text == TEXT and out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.tokens[0] == "<｜begin▁of▁sentence｜>" and "".join(lp.tokens[1:]) == TEXT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), want, rtol=0, atol=2e-3)
    assert lp.text_offset == [0] + [len("".join(lp.tokens[1:i])) for i in range(1, len(ids))]  # BOS: no text
    # logprobs=1: the single alternative is the model's most likely token, as lm-eval's is_greedy reads it
    top_pieces = [next(iter(t)) for t in lp.top_logprobs[1:]]
    assert len(top_pieces) == len(ids) - 1
    greedy = [lp.tokens[i + 1] == top_pieces[i] for i in range(len(ids) - 1)]
    assert greedy == (argmax == torch.tensor(ids[1:])).tolist()


def test_vllm_prompt_logprobs_alongside_generation(client, reference):
    ids, want, argmax = reference
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0,
                                    extra_body={"prompt_logprobs": 2, "ignore_eos": True})
    choice = out.choices[0]
    assert out.usage.completion_tokens == 3 and choice.logprobs is None
    scores = choice.model_extra["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    got = torch.tensor([entry[str(t)]["logprob"] for entry, t in zip(scores[1:], ids[1:])])
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)
    for entry, t, best in zip(scores[1:], ids[1:], argmax.tolist()):
        assert entry[str(best)]["rank"] == 1
        assert (entry[str(t)]["rank"] == 1) == (t == best)
        assert len(entry) in (2, 3)  # the prompt token and the top 2 (it may be one of them)


def test_held_out_loss_through_the_api_equals_the_reference(chunked_server, model_dir):
    from server.tokenizer import Tokenizer

    text = " ".join([TEXT] * 3)
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(text)
    length = 24
    got = score_text(chunked_server.url, text, length, chunked_server.api_key)
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nats, chars, n = 0.0, 0, (len(ids) - 1) // length
    with torch.no_grad():
        for i in range(n):
            w = torch.tensor(ids[i * length: (i + 1) * length + 1])
            logits = model(input_ids=w[None, :-1]).logits[0].float()  # [L, V]
            nats += torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum").item()
            chars += len(tok.decode(w[1:].tolist()))
    assert got.tokens == n * length and got.chars == chars
    assert math.isclose(got.nats, nats, rel_tol=1e-4)
    assert math.isclose(got.bits_per_char, nats / math.log(2) / chars, rel_tol=1e-4)


def test_scoring_is_refused_where_it_is_not_supported(client):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=model, prompt=TEXT, echo=True, logprobs=1, max_tokens=0, stream=True)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"prompt_logprobs": 1})
