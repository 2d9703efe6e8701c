"""The OpenAI API as the official `openai` client sees it, against a real `ringserve serve`."""

from __future__ import annotations

import json
import time
import urllib.request

import openai
import pytest




@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=60)


def _tokenize(server, text: str) -> list[int]:
    req = urllib.request.Request(server.url + "/tokenize", data=json.dumps({"prompt": text}).encode(),
                                 headers={"Authorization": f"Bearer {server.api_key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())["tokens"]


def test_chat_and_completion_with_usage(client, server):
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello there"}],
                                          max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 6
    assert chat.usage.prompt_tokens > 3 and chat.choices[0].message.role == "assistant"
    comp = client.completions.create(model=model, prompt="hello there", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert comp.usage.prompt_tokens == len(_tokenize(server, "hello there"))
    assert comp.usage.completion_tokens == 5 and comp.usage.total_tokens == comp.usage.prompt_tokens + 5


def test_streaming_equals_non_streaming_and_reports_usage(client):
    kw = dict(model=client.models.list().data[0].id, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt="stream me", **kw).choices[0].text
    chunks = list(client.completions.create(prompt="stream me", stream=True, stream_options={"include_usage": True},
                                            **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    chat_kw = dict(kw, messages=[{"role": "user", "content": "stream me"}])
    message = client.chat.completions.create(**chat_kw).choices[0].message
    stream = list(client.chat.completions.create(stream=True, **chat_kw))
    assert message.reasoning_content  # thinking on by default (DeepSeek's chat format): all of it is reasoning
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in stream) == \
        message.reasoning_content
    assert "".join(c.choices[0].delta.content or "" for c in stream) == message.content
    assert stream[-1].choices[0].finish_reason == "length"


def test_stop_strings_across_chunks(client):
    kw = dict(model=client.models.list().data[0].id, prompt="stop test", max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3 and "\ufffd" not in stop
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    streamed = list(client.completions.create(stop=[stop], stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == cut.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible_and_n_choices(client):
    kw = dict(model=client.models.list().data[0].id, prompt="sample", max_tokens=8, temperature=1.0, top_p=0.9,
              seed=42, extra_body={"ignore_eos": True})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    many = client.completions.create(n=3, **kw)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert many.usage.completion_tokens == 24, [(c.finish_reason, c.text) for c in many.choices]  # seen once as 20
    assert len({c.text for c in many.choices}) > 1


def test_logprobs(client):
    kw = dict(model=client.models.list().data[0].id, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    comp = client.completions.create(prompt="lp", logprobs=3, **kw).choices[0].logprobs
    assert len(comp.token_logprobs) == 4 and all(len(t) <= 3 for t in comp.top_logprobs)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "lp"}], logprobs=True,
                                          top_logprobs=2, **kw).choices[0].logprobs
    assert len(chat.content) == 4 and all(len(c.top_logprobs) == 2 for c in chat.content)
    assert all(c.logprob <= 0 for c in chat.content)


def test_models_version_tokenize_detokenize(server):
    status, body = server.get("/version", server.api_key)
    assert status == 200 and body["version"]
    ids = _tokenize(server, "round trip")
    req = urllib.request.Request(server.url + "/detokenize", data=json.dumps({"tokens": ids}).encode(),
                                 headers={"Authorization": f"Bearer {server.api_key}"})
    with urllib.request.urlopen(req) as r:
        assert json.loads(r.read())["prompt"] == "round trip"


def test_auth_required_except_health(server):
    assert server.get("/health")[0] == 200 and server.get("/ready")[0] == 200
    for path in ("/v1/models", "/version", "/metrics"):
        status, body = server.get(path)
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert server.get(path, "wrong-key")[0] == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_continuous_usage_counts_tokens_per_chunk(client):
    chunks = list(client.completions.create(
        model=client.models.list().data[0].id, prompt="count", max_tokens=7, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    running = [c.usage.completion_tokens for c in chunks if c.choices]
    assert running == sorted(running) and running[-1] == 7
    assert chunks[-1].usage.completion_tokens == 7


def test_the_http_process_never_loads_torch(client, server):
    """The front process parses, tokenizes and streams; only the workers hold the model. After
    real traffic, no torch (or numba) library is mapped into it."""
    client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=2)
    with open(f"/proc/{server.proc.pid}/maps") as f:
        mapped = f.read()
    assert "libtorch" not in mapped and "numba" not in mapped
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
        children = f.read().split()
    maps = []
    for pid in children:
        with open(f"/proc/{pid}/maps") as f:
            maps.append(f.read())
    assert any("libtorch" in m for m in maps)  # the check does see torch where it is: in the worker


def test_queue_time_is_measured_in_the_worker(client, server):
    client.completions.create(model=client.models.list().data[0].id, prompt="queue", max_tokens=2)
    req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {server.api_key}"})
    with urllib.request.urlopen(req) as r:
        text = r.read().decode()
    count = [line for line in text.splitlines() if line.startswith("ringserve:request_queue_time_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 1


def test_the_cpu_workers_thread_count_reaches_the_metrics(server):
    """From the worker's heartbeat (a --threads-per-worker 1 server: one thread, never fewer)."""
    deadline = time.monotonic() + 10
    while _metric(server, "ringserve:cpu_compute_threads") != 1 and time.monotonic() < deadline:
        time.sleep(0.2)  # metrics refresh once a second from heartbeats
    assert _metric(server, "ringserve:cpu_compute_threads") == 1


def _metric(server, name: str) -> float:
    req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {server.api_key}"})
    with urllib.request.urlopen(req) as r:
        text = r.read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)]
    return sum(values)


def test_a_repeated_prompt_is_served_from_the_prefix_cache_and_counted(client, server):
    """Same long prompt twice: the second reuses the first's full blocks (prefix caching is on by
    default) and gives the same greedy text; /metrics counts the hit tokens (vLLM's counter names)."""
    model = client.models.list().data[0].id
    prompt = "the prefix cache keeps full blocks of a prompt for the next request " * 6
    before = _metric(server, "ringserve:prefix_cache_hits_total")
    first = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    assert second.choices[0].text == first.choices[0].text
    deadline = time.monotonic() + 10
    while _metric(server, "ringserve:prefix_cache_hits_total") <= before and time.monotonic() < deadline:
        time.sleep(0.3)  # metrics refresh once a second from heartbeats
    assert _metric(server, "ringserve:prefix_cache_hits_total") > before
    assert _metric(server, "ringserve:prefix_cache_queries_total") >= 2 * second.usage.prompt_tokens
