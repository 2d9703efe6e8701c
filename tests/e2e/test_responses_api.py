"""OpenAI's Responses API (stateless) with the official `openai` client, against `ringserve serve`
on a tiny random DeepSeek-V4 (DeepSeek's chat format): reasoning items (on by default, off with
`reasoning.effort: "none"`), streamed events as the client's own stream accumulator reads them,
function tools with `tool_choice: "required"` giving a function_call whose arguments validate
against the tool's parameters (`jsonschema`), function_call / function_call_output turns whose
prompt is /tokenize's of the same conversation in chat form, `text.format` json_schema output
that validates, usage with cached and reasoning tokens, and the stateful parts refused
(`previous_response_id`, `item_reference`) with 400s naming the field.

The endpoint is a translation onto the chat path, so with greedy sampling each answer must equal
the chat-completions answer to the same conversation. Random weights never close a reasoning
section, so tool calls and JSON run with reasoning off.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from server_process import API_KEY, Server

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

ASK = "What time is it in Paris?"
CLOCK_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
CLOCK = {"type": "function", "name": "get_time", "description": "The time in a zone", "parameters": CLOCK_SCHEMA,
         "strict": True}
CLOCK_CHAT = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                               "parameters": CLOCK_SCHEMA}}
NO_REASONING = {"effort": "none"}


@pytest.fixture(scope="module")
def served(model_dir):
    s = Server(model_dir, "--max-num-seqs", "4")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _create(client, **kw):
    return client.responses.create(model="tiny", **{"input": ASK, "max_output_tokens": 24, "temperature": 0, **kw})


def _chat(client, **kw):
    return client.chat.completions.create(model="tiny", **{"messages": [{"role": "user", "content": ASK}],
                                                            "max_tokens": 24, "temperature": 0, **kw})


def _without_ids(items: list) -> list:
    ignored = ("id", "call_id", "parsed_arguments")  # fresh ids; the stream helper's own parse
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k not in ignored} for item in items]


def test_reasoning_is_on_by_default_whole_and_streamed(client):
    response = _create(client)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["reasoning"]
    reference = _chat(client)
    assert response.output[0].content[0].text == reference.choices[0].message.reasoning_content
    assert response.usage.output_tokens == 24 and response.usage.output_tokens_details.reasoning_tokens == 24
    assert response.usage.input_tokens == reference.usage.prompt_tokens and response.model_dump()["store"] is False

    events = list(_create(client, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == response.output[0].content[0].text
    final = events[-1].response
    assert _without_ids(final.output) == _without_ids(response.output)
    assert final.usage.output_tokens_details.reasoning_tokens == 24


def test_reasoning_effort_none_answers_with_a_message(client):
    response = _create(client, reasoning=NO_REASONING, instructions="Be brief.")
    assert [item.type for item in response.output] == ["message"]
    reference = _chat(client, reasoning_effort="none", messages=[{"role": "system", "content": "Be brief."},
                                                                  {"role": "user", "content": ASK}])
    assert response.output_text == reference.choices[0].message.content
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.usage.input_tokens == reference.usage.prompt_tokens
    with client.responses.stream(model="tiny", input=ASK, max_output_tokens=24, temperature=0, reasoning=NO_REASONING,
                                 instructions="Be brief.") as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert deltas == response.output_text


def test_required_tool_choice_gives_a_function_call_that_validates(client):
    kw = dict(tools=[CLOCK], tool_choice="required", parallel_tool_calls=False, reasoning=NO_REASONING,
              max_output_tokens=200)
    response = _create(client, **kw)
    assert response.status == "completed" and response.incomplete_details is None
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_time" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), CLOCK_SCHEMA)
    reference = _chat(client, tools=[CLOCK_CHAT], tool_choice="required", parallel_tool_calls=False,
                      reasoning_effort="none", max_tokens=200)
    assert reference.choices[0].message.tool_calls[0].function.arguments == calls[0].arguments

    with client.responses.stream(model="tiny", input=ASK, temperature=0, **kw) as stream:  # the client's accumulator
        events = list(stream)
        final = stream.get_final_response()
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert pieces == calls[0].arguments
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [calls[0].arguments]
    assert events[-1].type == "response.completed"
    assert _without_ids(final.output) == _without_ids(response.output)
    assert final.output[0].parsed_arguments == json.loads(calls[0].arguments)  # the client parsed the strict tool


def test_a_named_tool_choice(client):
    response = _create(client, tools=[CLOCK], tool_choice={"type": "function", "name": "get_time"},
                       parallel_tool_calls=False, reasoning=NO_REASONING, max_output_tokens=200)
    assert [item.name for item in response.output if item.type == "function_call"] == ["get_time"]


def test_function_call_output_turns(client, served):
    """An earlier turn's reasoning, message, call and output go back in as items: the prompt is
    exactly the one /tokenize renders for the same conversation in chat form."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": ASK}]},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Look it up."}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"zone": "CET"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "14:05"},
             {"role": "user", "content": "And in London?"}]
    as_chat = [{"role": "user", "content": ASK},
               {"role": "assistant", "content": "Let me check.", "reasoning_content": "Look it up.",
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "14:05"},
               {"role": "user", "content": "And in London?"}]
    expected = _post(served, "/tokenize", {"messages": as_chat, "tools": [CLOCK_CHAT]})["tokens"]
    response = _create(client, input=items, tools=[CLOCK], max_output_tokens=8)
    assert response.usage.input_tokens == len(expected)
    assert response.output[0].type == "reasoning"


def test_the_prefix_cache_hit_is_cached_tokens(client):
    long = "Summarize: " + "the ring buffer hands slots to the worker. " * 20
    first = _create(client, input=long, max_output_tokens=4, prompt_cache_key="session-9")
    second = _create(client, input=long, max_output_tokens=4, prompt_cache_key="session-9")
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens_details.cached_tokens >= 16  # at least one whole block
    assert second.usage.input_tokens == first.usage.input_tokens


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}, "ok": {"type": "boolean"}},
              "required": ["zone", "ok"], "additionalProperties": False}
    response = _create(client, reasoning=NO_REASONING, max_output_tokens=100,
                       text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize("body, param, fragment", [
    ({"previous_response_id": "resp_123"}, "previous_response_id", "stored responses"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "stored items"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]},
     "input", "image"),
    ({"tools": [{"type": "web_search"}]}, "tools", "function tools only"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "minimal, low"),
    ({"max_output_tokens": 4000}, "max_output_tokens", "maximum context length"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}}, "text", "text.format"),
    ({"tools": [{**CLOCK, "parameters": {"type": "frob"}}]}, "tools", "tools[0].parameters"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "input", "input[0]"),
])
def test_bad_requests_are_400s_naming_the_field(client, body, param, fragment):
    with pytest.raises(openai.BadRequestError) as err:
        _create(client, **body)
    error = err.value.body
    assert error["param"] == param and fragment in error["message"], error
    assert _create(client, max_output_tokens=2).usage.output_tokens == 2  # still serving


def test_store_true_is_served_statelessly(client):
    response = _create(client, store=True, max_output_tokens=2)
    assert response.model_dump()["store"] is False and response.usage.output_tokens == 2


# ---- helpers ------------------------------------------------------------------------------------------

def _post(server: Server, path: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())
