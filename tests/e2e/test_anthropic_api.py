"""Anthropic's Messages API with the official `anthropic` client, against `ringserve serve` on a tiny
random DeepSeek-V4 (DeepSeek's chat format): thinking blocks (on by default, disabled, effort),
tool_use with tool_choice any / tool whose input validates against its input_schema
(`jsonschema`), streamed events as the client's own stream accumulator reads them, a multi-turn
tool_use / tool_result conversation, count_tokens equal to /tokenize of the same conversation
in chat form, the prefix-cache hit as cache_read_input_tokens, stop sequences, x-api-key and
Bearer auth, Anthropic error bodies, images refused, unknown fields ignored.

The Messages endpoint is a translation onto the chat path, so with greedy sampling each answer
must equal the chat-completions answer to the same conversation (the official `openai` client).
Random weights never close a reasoning section, so tool calls run with thinking disabled, and
the thinking path is checked by its blocks and events carrying the reasoning text.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from server_process import API_KEY, Server

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

GREEDY = {"temperature": 0}  # recent Anthropic SDKs no longer take sampling fields as arguments
ASK = [{"role": "user", "content": "What time is it in Paris?"}]
CLOCK_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
CLOCK = {"name": "get_time", "description": "The time in a zone", "input_schema": CLOCK_SCHEMA,
         "cache_control": {"type": "ephemeral"}}  # an Anthropic-only field: ignored
CLOCK_CHAT = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                               "parameters": CLOCK_SCHEMA}}
NO_THINKING = {"type": "disabled"}


@pytest.fixture(scope="module")
def served(model_dir):
    s = Server(model_dir, "--max-num-seqs", "4")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served.url, api_key=API_KEY, max_retries=0, timeout=120)  # x-api-key


@pytest.fixture(scope="module")
def chat(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _create(client, **kw):
    return client.messages.create(model="tiny", **{"messages": ASK, "max_tokens": 24, "extra_body": GREEDY, **kw})


def _stream(client, **kw):
    """The raw events (pings aside) and the message the client's stream accumulator builds."""
    with client.messages.stream(model="tiny", **{"messages": ASK, "max_tokens": 24, "extra_body": GREEDY,
                                                 **kw}) as stream:
        events = [e for e in stream if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                  "content_block_stop", "message_delta", "message_stop")]
        return events, stream.get_final_message()


def test_thinking_is_on_by_default_whole_and_streamed(client, chat):
    message = _create(client)
    assert [b.type for b in message.content] == ["thinking"] and message.content[0].signature
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 24 and message.usage.output_tokens_details.thinking_tokens == 24
    reference = chat.chat.completions.create(model="tiny", messages=ASK, max_tokens=24, temperature=0)
    assert message.content[0].thinking == reference.choices[0].message.reasoning_content
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == reference.usage.prompt_tokens

    events, final = _stream(client)
    kinds = [e.type if e.type != "content_block_delta" else e.delta.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and events[1].content_block.type == "thinking"
    assert set(kinds[2:-4]) == {"thinking_delta"}
    assert kinds[-4:] == ["signature_delta", "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == message.content[0].thinking
    assert final.content[0].thinking == message.content[0].thinking and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 24 and final.usage.output_tokens_details.thinking_tokens == 24


def test_thinking_disabled_answers_in_a_text_block(client, chat):
    message = _create(client, thinking=NO_THINKING)
    assert [b.type for b in message.content] == ["text"] and message.usage.output_tokens_details.thinking_tokens == 0
    reference = chat.chat.completions.create(model="tiny", messages=ASK, max_tokens=24, temperature=0,
                                             extra_body={"chat_template_kwargs": {"thinking": False}})
    assert message.content[0].text == reference.choices[0].message.content
    events, final = _stream(client, thinking=NO_THINKING)
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == message.content[0].text
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == message.content[0].text


def test_thinking_settings_and_effort_reach_the_prompt(client, served):
    """enabled / adaptive / absent render the same thinking prompt; effort max adds V4's
    "Absolute maximum" paragraph (more input tokens); disabled closes the reasoning."""
    def count(**kw):
        return client.messages.count_tokens(model="tiny", messages=ASK, **kw).input_tokens

    base = count()
    assert count(thinking={"type": "enabled", "budget_tokens": 1024}) == base
    assert count(thinking={"type": "adaptive"}) == base
    assert count(output_config={"effort": "high"}) == base  # V4's default effort
    assert count(output_config={"effort": "max"}) > base + 20
    thinking = _post(served, "/tokenize", {"messages": ASK})["tokens"]
    chat_mode = _post(served, "/tokenize", {"messages": ASK, "chat_template_kwargs": {"thinking": False}})["tokens"]
    assert base == len(thinking) and count(thinking=NO_THINKING) == len(chat_mode)
    message = _create(client, thinking={"type": "enabled", "budget_tokens": 1024}, output_config={"effort": "max"})
    assert message.content[0].type == "thinking" and message.usage.input_tokens + \
        message.usage.cache_read_input_tokens == count(output_config={"effort": "max"})


def test_every_effort_level_is_one_the_model_takes():
    """Anthropic's and OpenAI's effort names land on values DeepSeek's encoders accept, in rising
    order; on V4.1 the names DeepSeek defines keep its values (low 50, high 75, max 100)."""
    from server.adapters.common import EFFORT_LEVELS, reasoning_fields
    from server.chat import resolve_effort

    for version in ("v4", "v41"):
        efforts = {level: resolve_effort(version, reasoning_fields(version, None, level, "effort")["reasoning_effort"])
                   for level in EFFORT_LEVELS}
        if version == "v4":
            assert set(efforts.values()) == {"high", "max"} and efforts["max"] == "max"
        else:
            assert [efforts[k] for k in ("low", "high", "max")] == [50, 75, 100]
            assert list(efforts.values()) == sorted(efforts.values())
    assert reasoning_fields(None, True, "max", "effort") == {}  # a template model has no reasoning switches


def test_tool_choice_any_gives_a_tool_use_that_validates(client, chat):
    kw = dict(tools=[CLOCK], tool_choice={"type": "any", "disable_parallel_tool_use": True}, thinking=NO_THINKING,
              max_tokens=200)
    message = _create(client, **kw)
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_time" and uses[0].id
    jsonschema.validate(uses[0].input, CLOCK_SCHEMA)
    reference = chat.chat.completions.create(model="tiny", messages=ASK, max_tokens=200, temperature=0,
                                             tools=[CLOCK_CHAT], tool_choice="required", parallel_tool_calls=False,
                                             extra_body={"chat_template_kwargs": {"thinking": False}})
    assert json.loads(reference.choices[0].message.tool_calls[0].function.arguments) == uses[0].input

    events, final = _stream(client, **kw)
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert starts[-1].type == "tool_use" and starts[-1].name == "get_time" and starts[-1].input == {}
    pieces = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                     and e.delta.type == "input_json_delta")
    assert json.loads(pieces) == uses[0].input
    assert [b.input for b in final.content if b.type == "tool_use"] == [uses[0].input]
    assert final.stop_reason == "tool_use"


def test_a_named_tool_is_called(client):
    message = _create(client, tools=[CLOCK], tool_choice={"type": "tool", "name": "get_time",
                                                          "disable_parallel_tool_use": True},
                      thinking=NO_THINKING, max_tokens=200)
    uses = [b for b in message.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["get_time"] and message.stop_reason == "tool_use"
    jsonschema.validate(uses[0].input, CLOCK_SCHEMA)


def test_a_multi_turn_tool_conversation(client, served):
    """tool_use / tool_result / thinking blocks go back in: the prompt is exactly the one
    /tokenize renders for the same conversation in chat form."""
    conversation = ASK + [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Look it up.", "signature": "opaque"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "CET"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "14:05"}],
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "And in London?"}]}]
    as_chat = ASK + [
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Look it up.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "14:05"},
        {"role": "user", "content": "And in London?"}]
    expected = len(_post(served, "/tokenize", {"messages": as_chat, "tools": [CLOCK_CHAT]})["tokens"])
    assert client.messages.count_tokens(model="tiny", messages=conversation, tools=[CLOCK]).input_tokens == expected
    message = _create(client, messages=conversation, tools=[CLOCK], max_tokens=8)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == expected
    assert message.content[0].type == "thinking"

    failed = conversation[:2] + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "no such zone", "is_error": True}]}]
    failed_chat = as_chat[:2] + [{"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no such zone"}]
    assert client.messages.count_tokens(model="tiny", messages=failed, tools=[CLOCK]).input_tokens == len(
        _post(served, "/tokenize", {"messages": failed_chat, "tools": [CLOCK_CHAT]})["tokens"])


def test_system_blocks_count_like_a_system_message(client, served):
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=5;"},  # dropped
              {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    counted = client.messages.count_tokens(model="tiny", system=system, messages=ASK).input_tokens
    expected = _post(served, "/tokenize", {"messages": [{"role": "system", "content": "You are terse."}, *ASK]})
    assert counted == len(expected["tokens"])
    assert client.messages.count_tokens(model="tiny", system="You are terse.", messages=ASK).input_tokens == counted


def test_the_prefix_cache_hit_is_cache_read_input_tokens(client):
    long = [{"role": "user", "content": "Summarize: " + "the ring buffer hands slots to the worker. " * 20}]
    first = _create(client, messages=long, max_tokens=4, metadata={"user_id": "session-7"})
    events, second = _stream(client, messages=long, max_tokens=4, metadata={"user_id": "session-7"})
    assert first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens >= 16  # at least one whole block
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == first.usage.input_tokens
    assert events[0].message.usage.input_tokens == first.usage.input_tokens  # message_start: the whole prompt


def test_a_stop_sequence_ends_the_message(client):
    thinking = _create(client).content[0].thinking
    stop = thinking[len(thinking) // 2: len(thinking) // 2 + 3]
    message = _create(client, stop_sequences=[stop, "never-generated"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].thinking == thinking[: thinking.index(stop)]
    _, final = _stream(client, stop_sequences=["never-generated", stop])
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_errors_are_anthropic_bodies(client, served):
    cases = [({"messages": []}, "messages"),
             ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
                 "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "image"),
             ({"max_tokens": 4000}, "maximum context length"),
             ({"stop_sequences": ["s"] * 17}, "'stop_sequences'"),
             ({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "tools[0].name"),
             ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
             ({"tool_choice": {"type": "any"}}, "no tools"),
             ({"thinking": {"type": "enabled"}}, "budget_tokens"),
             ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
             ({"messages": ASK + [{"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]}, "messages[1].content[0]")]
    for body, fragment in cases:
        with pytest.raises(anthropic.BadRequestError) as err:
            _create(client, **body)
        assert err.value.body["type"] == "error", err.value.body
        assert err.value.body["error"]["type"] == "invalid_request_error"
        assert fragment in err.value.body["error"]["message"], (fragment, err.value.body)
    status, answer = _post_status(served, "/v1/messages", {"model": "tiny", "messages": ASK})
    assert status == 400 and answer == {"type": "error", "error": {"type": "invalid_request_error",
                                                                   "message": "'max_tokens' is required"}}
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-sonnet-4", messages=ASK, max_tokens=4)
    assert err.value.body["error"]["type"] == "not_found_error"
    assert _create(client, max_tokens=2).stop_reason == "max_tokens"  # still serving


def test_api_key_as_x_api_key_or_bearer(served):
    wrong = anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(model="tiny", messages=ASK, max_tokens=2)
    assert err.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                         "message": "invalid or missing API key"}}
    bearer = anthropic.Anthropic(base_url=served.url, auth_token=API_KEY, max_retries=0)
    assert bearer.messages.create(model="tiny", messages=ASK, max_tokens=2).usage.output_tokens == 2
    assert served.get("/v1/models", key=API_KEY)[0] == 200  # Bearer (the test helper's) on every route
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(served.url + "/v1/models", headers={"x-api-key": API_KEY})) as r:
        assert json.loads(r.read())["data"][0]["id"] == "tiny"  # and x-api-key too
    status, answer = _post_status(served, "/v1/chat/completions", {"messages": ASK}, key="wrong")
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"  # OpenAI's shape on OpenAI routes


# ---- helpers ------------------------------------------------------------------------------------------

def _post_status(server: Server, path: str, body: dict, key: str = API_KEY) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "x-api-key": key})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _post(server: Server, path: str, body: dict) -> dict:
    status, answer = _post_status(server, path, body)
    assert status == 200, answer
    return answer
