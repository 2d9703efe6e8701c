"""The agentx request shape (perf/serving/conversation.py) and AIPerf's Weka trace format
(perf/serving/weka.py): histories that grow turn by turn with reasoning and tool turns, checked
against the official `openai` client's message types; Weka round trips and readings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perf.serving import agentx, conversation, textgen, trace, weka
from perf.serving.client import ApiConfig, build_payload

openai_chat = pytest.importorskip("openai.types.chat")
pydantic = pytest.importorskip("pydantic")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "perf" / "traces" / "agentx_example.jsonl"
BS = 64
MESSAGES = pydantic.TypeAdapter(list[openai_chat.ChatCompletionMessageParam])


def _valid_openai_messages(messages: list[dict]) -> None:
    """Validate against openai's ChatCompletionMessageParam (tool_calls are lazily checked: iterate)."""
    for msg in MESSAGES.validate_python(messages):
        list(msg.get("tool_calls") or ())


def _builder(**kw) -> conversation.Conversations:
    return conversation.Conversations(textgen.BlockText(seed=0, block_size=BS, tokens_per_word=1.0), "n0nce", **kw)


def _play(builder, tree_index: int, sess: trace.Session) -> list:
    specs = [builder.spec(tree_index, req) for req in sess.requests]
    builder.finish(tree_index, sess.session_id)
    return specs


def _words(text: str) -> int:
    return len(text.split())


def test_history_grows_by_the_recorded_reply_and_the_new_input():
    p = agentx.AgentXParams(num_sessions=6, turns=(6, 10), max_context=10**9, fork_prob=0.0, tool_use_share=0.5,
                            thinking_share=1.0)
    tool_turns = user_turns = 0
    for i, tree in enumerate(agentx.generate(p)):
        specs = _play(_builder(), i, tree)
        first = specs[0].messages
        assert [m["role"] for m in first] == ["system", "user"]
        assert first[0]["content"].startswith(f"[rid:n0nce-{i}]")
        r0 = tree.requests[0]
        # 1 token per word: the system message holds the system share of turn 0's prompt
        assert _words(first[0]["content"]) - 1 == r0.system_tokens
        assert _words(first[1]["content"]) == r0.input_length - r0.system_tokens
        for prev, cur, spec in zip(tree.requests, tree.requests[1:], specs[1:]):
            before = specs[cur.turn - 1].messages
            assert spec.messages[:len(before)] == before and len(spec.messages) == len(before) + 2
            reply, new = spec.messages[-2:]
            assert reply["role"] == "assistant"
            reasoning = _words(reply["reasoning_content"])
            assert reasoning == round(prev.output_length * 0.5)  # thinking_share 1: every reply reasons
            if prev.stop == "tool_use":
                tool_turns += 1
                (call,) = reply["tool_calls"]
                args = json.loads(call["function"]["arguments"])
                assert reasoning + _words(args["input"]) == prev.output_length
                assert new == {"role": "tool", "tool_call_id": call["id"], "content": new["content"]}
                assert cur.input_types == ("tool_result",)
            else:
                user_turns += 1
                assert "tool_calls" not in reply and reasoning + _words(reply["content"]) == prev.output_length
                assert new["role"] == "user" and cur.input_types == ("text",)
            assert _words(new["content"]) == cur.input_length - prev.input_length - prev.output_length
            _valid_openai_messages(spec.messages)
    assert tool_turns > 5 and user_turns > 5


def test_request_carries_agentx_fields_and_session_headers():
    tree = agentx.generate(agentx.AgentXParams(num_sessions=1, turns=(3, 3), fork_prob=0.0))[0]
    builder = _builder()
    spec = [builder.spec(7, r) for r in tree.requests][-1]
    key = f"n0nce-7-{tree.session_id}"
    assert spec.headers == {"X-Session-ID": key, "X-Correlation-ID": key}
    body = build_payload(ApiConfig(base_url="http://x", model="m", continuous_usage=False), spec)
    assert body["max_completion_tokens"] == tree.requests[-1].output_length and "max_tokens" not in body
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["user"] == key and body["messages"] == spec.messages and len(spec.messages) == 6


def test_tool_results_as_user_messages_and_no_reasoning():
    p = agentx.AgentXParams(num_sessions=3, turns=(5, 5), max_context=10**9, fork_prob=0.0, tool_use_share=1.0,
                            thinking_share=0.0)
    for i, tree in enumerate(agentx.generate(p)):
        specs = _play(_builder(tool_shaped=False), i, tree)
        roles = [m["role"] for m in specs[-1].messages]
        assert roles == ["system", "user"] + ["assistant", "user"] * 4
        assert all("reasoning_content" not in m and "tool_calls" not in m for m in specs[-1].messages)


def test_a_compaction_restarts_the_conversation():
    p = agentx.AgentXParams(num_sessions=10, turns=(20, 20), max_context=1500, fork_prob=0.0)
    restarts = 0
    for i, tree in enumerate(agentx.generate(p)):
        specs = _play(_builder(), i, tree)
        for prev, cur, spec in zip(tree.requests, tree.requests[1:], specs[1:]):
            if cur.input_length < prev.input_length:  # the generator compacted
                restarts += 1
                assert len(spec.messages) == 2 and spec.messages[0] == specs[0].messages[0]
    assert restarts > 0


def test_subagents_are_their_own_sessions_and_histories_are_forgotten():
    p = agentx.AgentXParams(num_sessions=4, fork_prob=0.6, max_context=10**9)
    tree = next(t for t in agentx.generate(p) if t.children)
    builder = _builder()
    for req in tree.requests:
        builder.spec(0, req)
        for child in tree.children.get(req.turn, []):
            specs = _play(builder, 0, child)
            assert specs[0].headers["X-Session-ID"] == f"n0nce-0-{child.session_id}"
            assert len(specs[0].messages) == 2
    builder.finish(0, tree.session_id)
    assert builder._live == {}


def test_weka_round_trip(tmp_path):
    p = agentx.AgentXParams(num_sessions=5, fork_prob=0.5)
    trees = agentx.generate(p)
    for as_dir, path in ((False, tmp_path / "t.jsonl"), (True, tmp_path / "dir")):
        weka.write_weka(path, trees, p.block_size, as_dir=as_dir)
        back, bs, fmt = weka.read_any(path)
        assert (bs, fmt) == (p.block_size, "weka")
        for a, b in zip(trees, back):
            ra, rb = a.all_requests(), b.all_requests()
            assert len(ra) == len(rb)
            for x, y in zip(ra, rb):
                assert (x.turn, x.input_length, x.output_length, x.hash_ids, x.stop, x.input_types, x.output_types,
                        x.system_tokens) == (y.turn, y.input_length, y.output_length, y.hash_ids, y.stop,
                                             y.input_types, y.output_types, y.system_tokens)
                assert y.delay_ms == pytest.approx(x.delay_ms, abs=1.0)
            assert sorted(a.children) == sorted(b.children)


def test_weka_reader_delays_subagents_and_errors(tmp_path):
    obj = {"id": "t", "models": ["m"], "block_size": 4, "hash_id_scope": "local", "tool_tokens": 3, "system_tokens": 5,
           "requests": [
               {"type": "subagent", "t": 0.0, "agent_id": "early", "subagent_type": "x", "status": "completed",
                "models": ["m"], "requests": [{"t": 0.0, "type": "n", "model": "m", "in": 4, "out": 1}]},
               {"t": 1.0, "type": "n", "model": "m", "in": 10, "out": 2, "hash_ids": [1, 2, 3], "api_time": 0.5},
               {"type": "subagent", "t": 2.0, "agent_id": "a1", "subagent_type": "x", "status": "completed",
                "models": ["m"], "system_tokens": 2, "requests": [
                    {"t": 2.25, "type": "n", "model": "m", "in": 6, "out": 3},
                    {"t": 3.0, "type": "s", "model": "m", "in": 12, "out": 0, "think_time": 0.1}]},
               {"t": 4.0, "type": "s", "model": "m", "in": 14, "out": 5, "stop": "end_turn"}]}
    path = tmp_path / "one.json"
    path.write_text(json.dumps(obj))
    (tree,), bs = weka.read_weka(path)
    assert bs == 4 and tree.session_id == "t" and [r.input_length for r in tree.requests] == [10, 14]
    assert tree.requests[0].system_tokens == 8
    assert tree.requests[1].delay_ms == pytest.approx(2500.0)  # 4.0 − 1.0 − api 0.5: end to start
    (child,) = tree.children[0]  # the subagent before any parent request is dropped, as AIPerf does
    assert child.session_id == "t::sa:a1" and child.requests[0].parent == ("t", 0)
    assert child.requests[0].delay_ms == pytest.approx(250.0)  # from its spawn
    assert child.requests[1].delay_ms == pytest.approx(100.0)  # think_time wins
    assert child.requests[1].output_length == 1 and child.requests[0].system_tokens == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "block_size": 4, "requests": [{"type": "q"}]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        weka.read_weka(bad)


def test_example_trace_is_a_weka_trace_with_reasoning_and_tool_turns(tmp_path):
    trees, bs, fmt = weka.read_any(EXAMPLE)
    assert (fmt, bs, len(trees)) == ("weka", 64, 8)
    reqs = [r for t in trees for r in t.all_requests()]
    assert any(t.children for t in trees)
    assert {r.stop for r in reqs} == {"tool_use", "end_turn"} and all("thinking" in r.output_types for r in reqs)
    assert max(r.input_length + r.output_length for r in reqs) <= 448  # fits the tiny model with room for markup
    flat = tmp_path / "flat.jsonl"  # the per-request format still reads as such
    trace.write_trace(flat, trees)
    back, bs, fmt = weka.read_any(flat)
    assert (fmt, bs) == ("flat", None) and len([r for t in back for r in t.all_requests()]) == len(reqs)


def test_cli_refuses_what_the_agentx_shape_cannot_send(tmp_path, capsys):
    from perf.serving import cli

    base = ["serve", "--url", "http://127.0.0.1:9", "--request-shape", "agentx", "--disable-tqdm"]
    assert cli.main([*base, "--workload", "agentx", "--endpoint", "completions"]) == 2
    assert "use --endpoint chat" in capsys.readouterr().err
    assert cli.main([*base, "--workload", "fixed"]) == 2
    assert "needs a session workload" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"id": "x", "block_size": 64, "requests": []}')
    assert cli.main([*base, "--model", "m", "--workload", "trace", "--trace", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"ringserve bench: error: {bad}: bad Weka trace: ValueError('no top-level")
