"""Reading DeepSeek-V4 / V4.1 output (server/chat): the strict parser against the parses DeepSeek's
own parser gives for the golden completions, and the streaming processor for serving (golden
completions in every chunking, truncated and malformed markup, and a fuzz over DSML fragments)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.chat import (
    CompletionParseError,
    ContentDelta,
    DeepSeekOutputProcessor,
    MessageDone,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallStart,
    encode_messages,
    generation_suffix,
    parse_completion,
    parse_completion_lenient,
)
from server.chat.deepseek_format import ASSISTANT, DSML_TAGS, EOS

GOLDEN = Path(__file__).resolve().parents[2] / ".." / "shared" / "golden" / "deepseek-encoding"
needs_golden = pytest.mark.skipif(
    not GOLDEN.is_dir(), reason=f"golden data {GOLDEN} absent (a plain clone has no ../shared)")
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def golden_parses() -> list:
    """(version, mode, completion, expected message) from parse_checks.json and extra/comp*."""
    if not GOLDEN.is_dir():
        return []
    cases = []
    for version in ("v4", "v41"):
        for check in json.loads((GOLDEN / version / "parse_checks.json").read_text("utf-8")):
            cases.append(pytest.param(version, check["thinking_mode"], check["completion"],
                                      check["expected"],
                                      id=f"{version}-{check['source']}-{check['assistant_turn']}"))
    for comp in json.loads((GOLDEN / "extra/cases.json").read_text("utf-8"))["completions"]:
        if "expected" in comp:
            text = (GOLDEN / "extra" / comp["completion"]).read_bytes().decode("utf-8")
            cases.append(pytest.param(comp["encoder"], comp["thinking_mode"], text,
                                      comp["expected"], id=comp["id"]))
    return cases


def golden_rejections() -> list:
    if not GOLDEN.is_dir():
        return []
    return [pytest.param(c["encoder"], c["thinking_mode"],
                         (GOLDEN / "extra" / c["completion"]).read_bytes().decode("utf-8"),
                         id=c["id"])
            for c in json.loads((GOLDEN / "extra/cases.json").read_text("utf-8"))["completions"]
            if "expected_error" in c]


def without_ids(message: dict) -> dict:
    return {**message, "tool_calls": [{k: v for k, v in call.items() if k != "id"}
                                      for call in message["tool_calls"]]}


def stream(text: str, version: str, mode: str, cuts: list[int] = (), **options):
    """Feeds `text` split at `cuts`; returns (events per feed, final message, tools_called)."""
    processor = DeepSeekOutputProcessor(version, mode, **options)
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    feeds = [processor.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])]
    last = processor.finish()
    done = last[-1]
    assert isinstance(done, MessageDone) and not any(isinstance(e, MessageDone) for e in last[:-1])
    return feeds + [last[:-1]], done.message, done.tools_called


def replay(feeds: list[list]) -> dict:
    """The message the events describe, rebuilt as a client would."""
    reasoning, content, calls = [], [], {}
    for events in feeds:
        for event in events:
            if isinstance(event, ReasoningDelta):
                reasoning.append(event.text)
            elif isinstance(event, ContentDelta):
                content.append(event.text)
            elif isinstance(event, ToolCallStart):
                assert event.index == len(calls) and re.fullmatch(r"call_[0-9a-f]{24}", event.id)
                calls[event.index] = {"id": event.id, "type": "function",
                                      "function": {"name": event.name, "arguments": ""}}
            else:
                assert isinstance(event, ToolCallArgumentsDelta)
                calls[event.index]["function"]["arguments"] += event.arguments
    return {"role": "assistant", "content": "".join(content),
            "reasoning_content": "".join(reasoning), "tool_calls": list(calls.values())}


@needs_golden
@pytest.mark.parametrize("version,mode,text,expected", golden_parses())
def test_golden_parses(version, mode, text, expected):
    assert parse_completion(text, version, mode) == expected
    assert without_ids(parse_completion_lenient(text, version, mode)) == expected
    feeds, final, tools_called = stream(text, version, mode, cuts=range(1, len(text)))
    assert without_ids(final) == expected and replay(feeds) == final
    assert tools_called == bool(expected["tool_calls"])


@needs_golden
@given(data=st.data())
@FAST
def test_golden_parses_in_any_chunking(data):
    version, mode, text, expected = data.draw(st.sampled_from(golden_parses())).values
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    feeds, final, _ = stream(text, version, mode, cuts)
    assert without_ids(final) == expected and replay(feeds) == final


@needs_golden
@pytest.mark.parametrize("version,mode,text", golden_rejections())
def test_golden_rejection_is_refused_strictly_and_served_as_content(version, mode, text):
    with pytest.raises(CompletionParseError):
        parse_completion(text, version, mode)
    message = parse_completion_lenient(text, version, mode)
    reasoning, after = text.split("</think>", 1)
    assert message == {"role": "assistant", "content": after, "reasoning_content": reasoning,
                       "tool_calls": []}


V4_CALL = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
           '<｜DSML｜parameter name="q" string="true">x</｜DSML｜parameter>\n'
           "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")


@pytest.mark.parametrize("mode,text,problem", [
    ("thinking", "no end of reasoning" + EOS, "missing </think>"),
    ("thinking", "r" + V4_CALL + EOS, "missing </think>"),
    ("chat", "no eos", "missing EOS"),
    ("chat", "a" + EOS + "more", "after EOS"),
    ("chat", "a <think> b" + EOS, "special token"),
    ("chat", "a" + V4_CALL + "tail" + EOS, "after the tool calls"),
    ("chat", "a" + V4_CALL.replace("</｜DSML｜parameter>\n", "</｜DSML｜parameter> ") + EOS,
     "parameter format error"),
    ("chat", "a" + V4_CALL.replace('string="true">x', 'string="true">x</｜DSML｜parameter>\n'
                                   '<｜DSML｜parameter name="q" string="true">y') + EOS,
     "duplicate parameter"),
    ("chat", "a" + V4_CALL.replace('invoke name="f">', 'invoke nam="f">') + EOS,
     "tool name format"),
])
def test_strict_refusals(mode, text, problem):
    with pytest.raises(CompletionParseError, match=problem):
        parse_completion(text, "v4", mode)
    parse_completion_lenient(text, "v4", mode)  # never raises


def test_cut_inside_reasoning_is_all_reasoning():
    feeds, final, called = stream("Let me think about </thi", "v4", "thinking", cuts=[20, 22])
    assert final == {"role": "assistant", "content": "", "reasoning_content":
                     "Let me think about </thi", "tool_calls": []} and not called
    streamed = "".join(e.text for e in feeds[0] + feeds[1] + feeds[2])
    assert streamed == "Let me think about "  # the partial </think> waits for the finish


def test_eos_is_stripped_and_text_after_it_continues():
    assert parse_completion_lenient("r</think>done" + EOS, "v41", "thinking")["content"] == "done"
    message = parse_completion_lenient("a" + EOS + "b" + EOS[:5], "v4", "chat")
    assert message["content"] == "ab" + EOS[:5]  # ignore_eos; a cut EOS prefix stays text


def test_chat_mode_has_no_reasoning_and_keeps_think_tags_as_text():
    message = parse_completion_lenient("x</think>y" + EOS, "v4", "chat")
    assert message["reasoning_content"] == "" and message["content"] == "x</think>y"


def test_tool_call_stream_never_shows_markup_as_content():
    text = "Sure, checking." + V4_CALL + EOS
    feeds, final, called = stream(text, "v4", "chat", cuts=range(1, len(text)))
    content = [e.text for events in feeds for e in events if isinstance(e, ContentDelta)]
    assert "".join(content) == "Sure, checking." and called
    assert final["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"q": "x"}'}


def test_truncated_and_malformed_blocks_come_back_as_content():
    invoke = V4_CALL[len("\n\n<｜DSML｜tool_calls>\n"):-len("\n</｜DSML｜tool_calls>")]
    block = "\n\n<｜DSML｜tool_calls>\n"
    # cut inside the second invoke: the first call stands, the rest is content
    cut = block + invoke + "\n" + invoke[:40]
    message = parse_completion_lenient("a" + cut, "v4", "chat")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"]
    assert message["content"] == "a" + "\n" + invoke[:40]
    # a repeated parameter makes the invoke malformed
    twice = invoke.replace("</｜DSML｜parameter>\n", "</｜DSML｜parameter>\n"
                           '<｜DSML｜parameter name="q" string="true">y</｜DSML｜parameter>\n')
    bad = "a" + block + twice + "\n</｜DSML｜tool_calls>" + EOS
    message = parse_completion_lenient(bad, "v4", "chat")
    assert message["tool_calls"] == [] and message["content"] == bad[: -len(EOS)]
    # an unclosed invoke cut right after its header (DeepSeek's parser calls that a call)
    header_only = "a" + block + '<｜DSML｜invoke name="f">\n'
    assert parse_completion(header_only, "v4", "chat")["tool_calls"][0]["function"] == {
        "name": "f", "arguments": "{}"}
    assert parse_completion_lenient(header_only, "v4", "chat")["content"] == header_only


def test_non_json_value_is_repaired_and_blocks_may_repeat():
    call = V4_CALL.replace('string="true">x', 'string="false">ls -la')
    text = "a" + call + "then" + V4_CALL.replace('"f"', '"g"') + EOS
    message = parse_completion_lenient(text, "v4", "chat")
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "f", "arguments": '{"q": "ls -la"}'}, {"name": "g", "arguments": '{"q": "x"}'}]
    assert message["content"] == "athen"
    assert parse_completion("a" + call + EOS, "v4", "chat")["tool_calls"][0]["function"][
        "arguments"] == '{"q": ls -la}'  # DeepSeek's parser copies it verbatim


def test_tool_parsing_can_be_switched_off():
    text = "a" + V4_CALL + EOS
    message = parse_completion_lenient(text, "v4", "chat", parse_tool_calls=False)
    assert message["content"] == "a" + V4_CALL and message["tool_calls"] == []


def test_v41_reads_only_its_own_tag_spelling():
    v41_call = V4_CALL.replace("｜DSML｜", "｜DSML｜ ").replace("tool_calls", "calls")
    assert parse_completion_lenient("a" + v41_call + EOS, "v41", "chat")["tool_calls"]
    assert parse_completion_lenient("a" + V4_CALL + EOS, "v41", "chat")["content"] == "a" + V4_CALL


SAFE_TEXT = st.text(alphabet="ab c<>/\n\t\"\\{}[]:,中🙂é", max_size=12)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6)
    | st.floats(allow_nan=False, allow_infinity=False) | SAFE_TEXT,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text("abc", min_size=1, max_size=3), inner, max_size=3),
    max_leaves=6)
ARGUMENTS = st.dictionaries(st.text("abcxyz_", min_size=1, max_size=6), JSON_VALUES, max_size=4)


@given(version=st.sampled_from(["v4", "v41"]), reasoning=SAFE_TEXT, content=SAFE_TEXT,
       calls=st.lists(st.tuples(st.text("fgh_", min_size=1, max_size=5), ARGUMENTS),
                      max_size=3),
       cuts=st.lists(st.integers(0, 10**4), max_size=10))
@FAST
def test_encoded_assistant_turns_read_back(version, reasoning, content, calls, cuts):
    """An assistant turn rendered by the encoder is what the model writes; both readers give the
    same message back, in every chunking."""
    turn = {"role": "assistant", "reasoning_content": reasoning, "content": content,
            "tool_calls": [{"id": f"c{k}", "type": "function",
                            "function": {"name": name, "arguments": json.dumps(args)}}
                           for k, (name, args) in enumerate(calls)]}
    prompt = encode_messages([{"role": "user", "content": "q"}, turn], version=version,
                             thinking_mode="thinking")
    completion = prompt.split(ASSISTANT + generation_suffix("thinking"), 1)[1]
    strict = parse_completion(completion, version, "thinking")
    assert (strict["reasoning_content"], strict["content"]) == (reasoning, content)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in strict["tool_calls"]] == calls
    feeds, final, called = stream(completion, version, "thinking", cuts)
    assert without_ids(final) == strict and replay(feeds) == final and called == bool(calls)


def fragments(version: str) -> list[str]:
    t = DSML_TAGS[version]
    return ["</think>", "<think>", EOS, EOS[:7], "\n\n", "\n", " ", "text", "<", ">", '"', "｜",
            t.block_open, t.block_close, t.block_open[:9], t.invoke_open, t.invoke_close,
            t.invoke_close[:-1], t.parameter_open, t.parameter_close, t.parameter_close[:6],
            ' name="f">', ' name="f">\n', ' name="a" string="true">', ' name="b" string="false">',
            "1", "[1, 2]", "{", "x y"]


@given(data=st.data(), version=st.sampled_from(["v4", "v41"]),
       mode=st.sampled_from(["chat", "thinking"]))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fuzz_dsml_fragments(data, version, mode):
    """Random markup pieces in random chunks: never an exception, the same result for every
    chunking, events that add up to the final message, and no streamed text taken back."""
    pieces = data.draw(st.lists(st.sampled_from(fragments(version)), max_size=24))
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=16))
    whole = parse_completion_lenient(text, version, mode)
    processor = DeepSeekOutputProcessor(version, mode)
    bounds = [0, *sorted(cuts), len(text)]
    feeds = []
    for a, b in zip(bounds, bounds[1:]):
        feeds.append(processor.feed(text[a:b]))
        so_far = processor.message()
        assert whole["content"].startswith(so_far["content"])
        assert whole["reasoning_content"].startswith(so_far["reasoning_content"])
        assert [without_ids({"tool_calls": [c]})["tool_calls"][0] for c in so_far["tool_calls"]] \
            == without_ids(whole)["tool_calls"][: len(so_far["tool_calls"])]
    last = processor.finish()
    feeds.append(last[:-1])
    assert without_ids(last[-1].message) == without_ids(whole)
    assert replay(feeds) == last[-1].message
    assert "</think>" not in whole["reasoning_content"] and EOS not in whole["content"]


def test_processor_misuse_is_an_error():
    processor = DeepSeekOutputProcessor("v4", "chat")
    processor.finish()
    with pytest.raises(RuntimeError):
        processor.feed("x")
    with pytest.raises(ValueError):
        DeepSeekOutputProcessor("v5", "chat")
