"""The `agentx` request shape: each turn of a session as the chat request an agent harness sends.

As AIPerf replays the AgentX corpus (`--scenario inferencex-agentx-mvp --endpoint-type chat
--streaming`), every turn resends the whole conversation so far:

    turn 0:  [system (marker + system prompt and tools), user]
    turn k:  turn k−1's messages + the assistant's RECORDED reply to turn k−1
             + the new input (a `tool` result when that reply ended in a tool call, else `user`)

The recorded reply (not the server's output) goes into the history, so every run sends the
same bytes and the prefix structure follows the trace. A reply of `output_length` tokens whose
trace says it held a reasoning section (`output_types` has "thinking") carries the first
`reasoning_share` of them as `reasoning_content`; one that ended in a tool call (`stop` is
"tool_use") carries the rest as the arguments of one `tool_calls` entry (id `call_<turn>`,
function `recorded_tool`, as AIPerf's tool-shaped mode), answered by a `tool` message with that
`tool_call_id`; otherwise the rest is `content`. With `tool_shaped` off, tool results are plain
user messages (AIPerf's default).

Lengths: the new input is the turn's `input_length` minus the previous turn's prompt and reply
(at least one token; a reply is shortened when the trace's prompt grew by less than it, as when
a harness drops old reasoning). A turn whose hash ids do not extend the previous turn's full
blocks (or whose prompt did not grow) restarts the conversation: a compaction. Text comes from
`BlockText.span` over the turn's hash ids (salted per tree), so messages standing for the same
blocks are the same text, except that the system prompt's last partial block takes an id derived
from its first block (the rest of that block is the user's message, so its trace id changes with
it, while the system message must not); the tree's cache-bust marker opens the first message.

Each request also carries the session key (`<run nonce>-<tree>-<session id>`; a subagent is its own
session, as in AIPerf) in the `X-Session-ID` and `X-Correlation-ID` headers and as `user`, asks
for `max_completion_tokens` = the recorded output length, and (client.py) `ignore_eos` and
`stream_options.include_usage`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from perf.serving.records import RequestSpec
from perf.serving.textgen import BlockText
from perf.serving.trace import TraceRequest

TOOL_NAME = "recorded_tool"
SYSTEM_TAIL = 1 << 46  # marks the id of the system prompt's last partial block


@dataclass(slots=True)
class _History:
    messages: list[dict[str, Any]] = field(default_factory=list)
    last: TraceRequest | None = None
    last_ids: tuple[int, ...] = ()


class Conversations:
    """Builds each turn's request from the session's history (one history per live session)."""

    def __init__(self, blocks: BlockText, nonce: str, reasoning_share: float = 0.5, tool_shaped: bool = True) -> None:
        if not 0.0 <= reasoning_share <= 1.0:
            raise ValueError("reasoning share must be in [0, 1]")
        self.blocks, self.nonce = blocks, nonce
        self.reasoning_share, self.tool_shaped = reasoning_share, tool_shaped
        self._live: dict[tuple[int, str], _History] = {}

    def session_key(self, tree_index: int, session_id: str) -> str:
        return f"{self.nonce}-{tree_index}-{session_id}"

    def spec(self, tree_index: int, req: TraceRequest, max_tokens: int | None = None) -> RequestSpec:
        """Turn `req` of its session as a request; turns of a session must come in order."""
        salted = tuple((tree_index << 40) | h for h in req.hash_ids)
        hist = self._live.setdefault((tree_index, req.session_id), _History())
        if hist.last is None or not self._extends(hist, req, salted):
            hist.messages = self._opening(tree_index, req, salted)
        else:
            hist.messages.extend(self._next_messages(hist, req, salted))
        hist.last, hist.last_ids = req, salted
        key = self.session_key(tree_index, req.session_id)
        return RequestSpec(prompt="", max_tokens=max_tokens or req.output_length, input_length=req.input_length,
                           session_id=req.session_id, turn=req.turn, hash_ids=salted,
                           extra_body={"user": key}, messages=list(hist.messages),
                           headers={"X-Session-ID": key, "X-Correlation-ID": key},
                           max_tokens_field="max_completion_tokens")

    def finish(self, tree_index: int, session_id: str) -> None:
        """Forget a session's history (its last turn was sent)."""
        self._live.pop((tree_index, session_id), None)

    # ---- the messages --------------------------------------------------------------------------------
    def _extends(self, hist: _History, req: TraceRequest, ids: tuple[int, ...]) -> bool:
        prev = hist.last
        full = min(len(hist.last_ids), prev.input_length // self.blocks.block_size)
        return req.input_length > prev.input_length and ids[:full] == hist.last_ids[:full]

    def _opening(self, tree_index: int, req: TraceRequest, ids: tuple[int, ...]) -> list[dict[str, Any]]:
        marker = f"[rid:{self.nonce}-{tree_index}]\n\n"
        system = min(req.system_tokens, req.input_length - 1)
        if system <= 0:
            return [{"role": "user", "content": marker + self.blocks.span(ids, 0, req.input_length)}]
        full = system // self.blocks.block_size
        system_ids = list(ids[:full]) + [(ids[0] if ids else 0) ^ SYSTEM_TAIL]
        return [{"role": "system", "content": marker + self.blocks.span(system_ids, 0, system)},
                {"role": "user", "content": self.blocks.span(ids, system, req.input_length)}]

    def _next_messages(self, hist: _History, req: TraceRequest, ids: tuple[int, ...]) -> list[dict[str, Any]]:
        prev = hist.last
        start = prev.input_length
        reply_len = max(0, min(prev.output_length, req.input_length - start - 1))
        reply_end = start + reply_len
        reasoning = round(reply_len * self.reasoning_share) if "thinking" in prev.output_types else 0
        tool = prev.stop == "tool_use" and self.tool_shaped
        reply: dict[str, Any] = {"role": "assistant"}
        if reasoning:
            reply["reasoning_content"] = self.blocks.span(ids, start, start + reasoning)
        body = self.blocks.span(ids, start + reasoning, reply_end) if reply_end > start + reasoning else ""
        if tool:
            call_id = f"call_{prev.turn}"
            reply["content"] = None
            reply["tool_calls"] = [{"id": call_id, "type": "function",
                                    "function": {"name": TOOL_NAME, "arguments": json.dumps({"input": body})}}]
            new = {"role": "tool", "tool_call_id": call_id}
        else:
            reply["content"] = body
            new = {"role": "user"}
        new["content"] = self.blocks.span(ids, reply_end, req.input_length)
        return [reply, new]
