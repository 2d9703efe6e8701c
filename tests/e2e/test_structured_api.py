"""Structured outputs over HTTP with the official `openai` client, against `ringserve serve` on a
random-weight tiny V4 with MTP (k = 3) and async scheduling.

Every test schema (tests/structured_schemas.py, 21 of them: nested objects, arrays with min/max
items, enums, anyOf/oneOf, $ref and recursion, patterns, bounded numbers, ...) gives output that
`json.loads` parses and `jsonschema` validates — greedy and sampled, through
`response_format: json_schema` on chat completions and `structured_outputs` on completions, and
streamed. Regex output fullmatches, choice output is one of the choices, n > 1 gives n valid
outputs. Bad specifications are 400s naming the problem (invalid schema, unenforceable keyword,
a regex that does not compile, two grammars at once, an oversized spec, a spec that does not
compile within the deadline), and the server keeps serving.

Chat requests turn DeepSeek's thinking off: a response format starts after the reasoning section,
which random weights never close within a test's budget (the grammar after `</think>` is tested
in tests/engine/test_structured_outputs.py and through forced tool choices in test_agent_chat.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.structured_schemas import SCHEMAS  # noqa: E402

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

from server_process import API_KEY, Server  # noqa: E402


@pytest.fixture(scope="module")
def served(model_dir):
    s = Server(model_dir, "--max-num-seqs", "48", "--speculative-tokens", "3", "--async-scheduling",
               "--structured-outputs-compile-timeout", "2")
    yield s
    assert s.stop() == 0, s.output()


NO_THINKING = {"chat_template_kwargs": {"thinking": False}}


def _client(server: Server) -> "openai.AsyncOpenAI":
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def test_every_schema_greedy_and_sampled(served):
    """42 concurrent requests: each schema greedy (chat, response_format) and sampled
    (completions, structured_outputs)."""
    async def main():
        client = _client(served)
        chats = [client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Give me {name} as JSON."}], max_tokens=400,
            temperature=0, extra_body=NO_THINKING,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
            for name, schema in SCHEMAS.items()]
        completions = [client.completions.create(
            model="tiny", prompt=f"{name}:", max_tokens=400, temperature=1.0, seed=i,
            extra_body={"structured_outputs": {"json": schema}})
            for i, (name, schema) in enumerate(SCHEMAS.items())]
        return await asyncio.gather(*chats), await asyncio.gather(*completions)

    chats, completions = asyncio.run(main())
    for (name, schema), chat, completion in zip(SCHEMAS.items(), chats, completions):
        for text, reason in ((chat.choices[0].message.content, chat.choices[0].finish_reason),
                             (completion.choices[0].text, completion.choices[0].finish_reason)):
            assert reason == "stop", (name, text)
            jsonschema.validate(json.loads(text), schema)


def test_streamed_regex_choice_and_n(served):
    async def main():
        client = _client(served)
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "A code?"}], max_tokens=60, temperature=0.8, seed=5,
            stream=True, extra_body={**NO_THINKING, "structured_outputs": {"regex": r"[A-Z]{3}-[0-9]{3}"}})
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        choice = await client.completions.create(model="tiny", prompt="Pick:", max_tokens=20, n=3, temperature=1.0,
                                                 seed=2, extra_body={"structured_outputs": {"choice": ["alpha", "beta",
                                                                                                     "gamma delta"]}})
        json_object = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "JSON"}], max_tokens=300, temperature=0,
            extra_body=NO_THINKING,
            response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMAS["nested"]}},
            logprobs=True, top_logprobs=2)
        return streamed, choice, json_object

    streamed, choice, json_object = asyncio.run(main())
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{3}", streamed), streamed
    assert len(choice.choices) == 3 and all(c.text in ("alpha", "beta", "gamma delta") for c in choice.choices)
    jsonschema.validate(json.loads(json_object.choices[0].message.content), SCHEMAS["nested"])
    assert len(json_object.choices[0].logprobs.content) == json_object.usage.completion_tokens


PATHOLOGICAL = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{1,40}"}
                                                            for i in range(40)},
                           "required": [f"k{i}" for i in range(40)]} for _ in range(40)]}  # ~20 s to compile


@pytest.mark.parametrize("extra,fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                         "properties": {"a": {"type": "frob"}}}}}},
     "not a valid JSON Schema"),
    ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}, "cannot enforce: uniqueItems"),
    ({"structured_outputs": {"regex": "(ab"}}, "regex specification does not compile"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "give exactly one"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "grammar specification does not compile"),
    ({"structured_outputs": {"choice": []}}, "non-empty strings"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "give one"),
    ({"structured_outputs": {"regex": "a" * (300 << 10)}}, "at most"),
    ({"structured_outputs": {"json": PATHOLOGICAL}}, "did not compile within 2 s"),
])
def test_bad_specifications_are_400s_and_the_server_keeps_serving(served, extra, fragment):
    async def main():
        client = _client(served)
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, extra_body=extra)
        ok = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, extra_body={"structured_outputs": {"regex": "[a-z]+"}})
        return err.value, ok

    error, ok = asyncio.run(main())
    assert fragment in error.message, error.message
    assert re.fullmatch("[a-z]+", ok.choices[0].message.content or "x") or ok.choices[0].finish_reason == "length"
