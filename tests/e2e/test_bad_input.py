"""Every malformed request gets an OpenAI-style 4xx (never a 5xx or a stack trace); each cap is
tested at the cap and just over it."""

from __future__ import annotations

import http.client
import json

import pytest

from server.protocol import Limits

LIMITS = Limits()


def post(server, path: str, body, raw: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    data = raw if raw is not None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {server.api_key}", **(headers or {})}
    conn.request("POST", path, body=data, headers=hdrs)
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    try:
        parsed = json.loads(payload) if payload else {}
    except json.JSONDecodeError:
        parsed = {"raw": payload.decode(errors="replace")}
    return resp.status, parsed


def assert_error(status: int, body: dict, expected: int, param: str | None = None, fragment: str = "") -> None:
    assert status == expected, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert "Traceback" not in err["message"] and fragment in err["message"]
    if param is not None:
        assert err["param"] == param


def chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


@pytest.mark.parametrize("raw, fragment", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2, 3]", "JSON object"),
    (b"\xff\xfe{}", "UTF-8"),
    (b"", "not valid JSON"),
])
def test_malformed_bodies(server, raw, fragment):
    assert_error(*post(server, "/v1/chat/completions", None, raw=raw), 400, fragment=fragment)


@pytest.mark.parametrize("body, param", [
    (chat(temperature="hot"), "temperature"),
    (chat(temperature=-0.5), "temperature"),
    (chat(top_p=1.5), "top_p"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(n=0), "n"),
    (chat(seed=True), "seed"),
    (chat(stop=[""]), "stop"),
    (chat(stream="yes"), "stream"),
    (chat(presence_penalty=3), "presence_penalty"),
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(chat_template="{{ 7*7 }}"), "chat_template"),
    (chat(chat_template_kwargs={"x": 1}), "chat_template_kwargs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": "hi"}, "messages"),
])
def test_invalid_chat_fields(server, body, param):
    assert_error(*post(server, "/v1/chat/completions", body), 400, param)


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [1, 10**6]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
])
def test_invalid_completion_fields(server, body, param):
    assert_error(*post(server, "/v1/completions", body), 400, param)


def test_unknown_model_is_404(server):
    assert_error(*post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404, "model")


def test_context_overflow_names_both_numbers(server):
    status, body = post(server, "/v1/completions", {"prompt": [5] * 100, "max_tokens": 2000})
    assert_error(status, body, 400, "max_tokens", "100 in the prompt plus 2000")
    assert "1024" in body["error"]["message"]  # the tiny model's context
    status, body = post(server, "/v1/completions", {"prompt": [5] * 1024})
    assert_error(status, body, 400, "prompt", "1024 tokens")


@pytest.mark.parametrize("field, at_cap, over", [
    ("n", LIMITS.max_n, LIMITS.max_n + 1),
    ("logprobs", LIMITS.max_logprobs, LIMITS.max_logprobs + 1),
    ("stop", ["s"] * LIMITS.max_stop, ["s"] * (LIMITS.max_stop + 1)),
])
def test_caps_at_and_over(server, field, at_cap, over):
    base = {"prompt": "cap", "max_tokens": 1}
    status, body = post(server, "/v1/completions", {**base, field: at_cap})
    assert status in (200, 429), body  # accepted (or momentarily full), never refused as invalid
    assert_error(*post(server, "/v1/completions", {**base, field: over}), 400, field)


def test_body_size_cap(server):
    cap = LIMITS.max_body_bytes
    head = b'{"prompt": "x", "max_tokens": 1, "x_padding": "'
    tail = b'"}'
    at_cap = head + b"a" * (cap - len(head) - len(tail)) + tail
    assert len(at_cap) == cap
    status, body = post(server, "/v1/completions", None, raw=at_cap)
    assert status in (200, 429), body
    status, body = post(server, "/v1/completions", None, raw=at_cap[:-2] + b'a"}')
    assert_error(status, body, 413)


def test_header_size_cap(server):
    field = LIMITS.max_field_bytes - len("X-Pad: ")
    status, _ = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, headers={"X-Pad": "a" * (field - 10)})
    assert status in (200, 429)
    status, body = post(server, "/v1/completions", {"prompt": "x"}, headers={"X-Pad": "a" * (LIMITS.max_field_bytes + 10)})
    assert status in (400, 431) and "Traceback" not in json.dumps(body)


def test_stop_list_too_long_string(server):
    assert_error(*post(server, "/v1/completions", {"prompt": "x", "stop": ["a" * (LIMITS.max_stop_chars + 1)]}), 400,
                 "stop")


def test_user_cap(server):
    base = {"prompt": "x", "max_tokens": 1}
    status, body = post(server, "/v1/completions", {**base, "user": "u" * LIMITS.max_user_chars})
    assert status in (200, 429), body
    assert_error(*post(server, "/v1/completions", {**base, "user": "u" * (LIMITS.max_user_chars + 1)}), 400, "user")


# ---- values that pass the API's own checks but not the wire types': 400 naming the field ----------

@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "top_k": 2**31}, "top_k"),
    ({"prompt": "x", "top_k": 2**80}, "top_k"),
    ({"prompt": "x", "stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids"),
    ({"prompt": "x", "seed": 2**63}, "seed"),
    ({"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ({"prompt": "x", "max_tokens": 2**31}, "max_tokens"),
    ({"prompt": [1, 2**40]}, "prompt"),
])
def test_values_beyond_the_wire_types(server, body, param):
    assert_error(*post(server, "/v1/completions", {"max_tokens": 1, **body}), 400, param)


def test_the_largest_seed_with_several_choices(server):
    """seed + choice index must not overflow int64 for n > 1: the choices' seeds wrap."""
    status, body = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 3, "seed": 2**63 - 1,
                                                     "temperature": 1.0})
    assert status == 200 and len(body["choices"]) == 3, body


@pytest.mark.parametrize("path, raw", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 1, "user": "\\ud83d"}'),
    ("/tokenize", b'{"prompt": "\\ud800"}'),
    ("/v1/completions", b'{"prompt": "\xed\xa0\x80", "max_tokens": 1}'),  # a surrogate encoded as UTF-8
])
def test_lone_surrogates(server, path, raw):
    assert_error(*post(server, path, None, raw=raw), 400)


def test_json_nested_thousands_deep(server):
    raw = b'{"prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert_error(*post(server, "/v1/completions", None, raw=raw), 400, fragment="nested")


def test_gzip_body_that_is_not_gzip(server):
    raw = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    assert_error(*post(server, "/v1/completions", None, raw=raw, headers={"Content-Encoding": "gzip"}), 400)


def test_more_choices_than_can_ever_run_is_400_not_429(server):
    body = {"prompt": ["p"] * LIMITS.max_prompts, "n": LIMITS.max_n, "max_tokens": 1}
    assert_error(*post(server, "/v1/completions", body), 400, "n", "can ever hold")


# ---- aiohttp's own parser errors answer in OpenAI JSON ------------------------------------------

def raw_http(server, request: bytes) -> tuple[int, dict]:
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.find(b"\r\n\r\n") + 4 + _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


@pytest.mark.parametrize("request_bytes", [
    b"FOO\x01 /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",  # a bad method
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20000 + b"\r\n\r\n",  # an oversized header
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(300)) + b"\r\n",
    # request smuggling: both a length and a chunked body
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
])
def test_parser_errors_are_openai_json(server, request_bytes):
    status, body = raw_http(server, request_bytes)
    assert 400 <= status < 500
    assert set(body["error"]) >= {"message", "type", "param", "code"} and "Traceback" not in body["error"]["message"]
