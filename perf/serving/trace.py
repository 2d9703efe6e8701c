"""The session-trace format shared by the AgentX-like generator and `--workload trace`.

A trace is JSONL, one request per line:

    {"session_id": "7", "turn": 0, "input_length": 9120, "output_length": 41,
     "hash_ids": [101, 102, ...], "delay_ms": 0.0, "parent": null}
    {"session_id": "7.3.0", "turn": 0, ..., "parent": {"session_id": "7", "turn": 3}}

* `input_length` / `output_length`: prompt and completion tokens (`max_tokens`, sent with
  `ignore_eos`).
* `hash_ids`: one id per `block_size`-token block of the prompt (last one may be partial); equal
  ids mean equal content, so the prefix a request shares with earlier ones is the run of its
  leading ids already seen. Ids need only be unique within a session tree.
* `delay_ms`: think time before the request: after the session's previous turn finished (and
  its subagents joined), or for a subagent's first turn after its parent turn finished.
* `parent`: null for a top-level session; otherwise the (session, turn) that forks this
  subagent. The parent's next turn waits until all its subagents finish.

Optional fields (absent = unknown; used by the `agentx` request shape, perf/serving/conversation.py):

* `stop`: how the recorded reply ended: "tool_use" (the next turn's new input is the tool's
  result) or "end_turn".
* `input_types` / `output_types`: what the new input and the recorded reply held, in the Weka
  corpus' words: "text", "tool_result" / "thinking", "text", "tool_use".
* `system_tokens`: how many leading prompt tokens are the system prompt and tool definitions
  (sent as the system message when a conversation starts or restarts).

The same sessions can be stored in AIPerf's Weka format (the AgentX corpus): perf/serving/weka.py.

A session tree (a top-level session and its subagents) is the unit of concurrency, and gets a
unique cache-bust marker per play. Lines may come in any order; turns are sorted per session.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class TraceRequest:
    """One request of a session."""

    session_id: str
    turn: int
    input_length: int
    output_length: int
    hash_ids: list[int]
    delay_ms: float = 0.0
    parent: tuple[str, int] | None = None
    stop: str = ""
    input_types: tuple[str, ...] = ()
    output_types: tuple[str, ...] = ()
    system_tokens: int = 0

    def to_json(self) -> dict:
        parent = None if self.parent is None else {"session_id": self.parent[0], "turn": self.parent[1]}
        out = {"session_id": self.session_id, "turn": self.turn, "input_length": self.input_length,
               "output_length": self.output_length, "hash_ids": self.hash_ids,
               "delay_ms": round(self.delay_ms, 3), "parent": parent}
        if self.stop:
            out["stop"] = self.stop
        if self.input_types:
            out["input_types"] = list(self.input_types)
        if self.output_types:
            out["output_types"] = list(self.output_types)
        if self.system_tokens:
            out["system_tokens"] = self.system_tokens
        return out

    @classmethod
    def from_json(cls, d: dict) -> "TraceRequest":
        p = d.get("parent")
        parent = None if not p else (str(p["session_id"]), int(p["turn"]))
        return cls(str(d["session_id"]), int(d.get("turn", 0)), int(d["input_length"]),
                   int(d["output_length"]), [int(h) for h in d.get("hash_ids", [])],
                   float(d.get("delay_ms", 0.0)), parent, str(d.get("stop") or ""),
                   tuple(str(t) for t in d.get("input_types") or ()),
                   tuple(str(t) for t in d.get("output_types") or ()), int(d.get("system_tokens") or 0))


@dataclass(slots=True)
class Session:
    """A sequence of turns; `children[turn]` are the subagents forked after that turn."""

    session_id: str
    requests: list[TraceRequest] = field(default_factory=list)
    children: dict[int, list["Session"]] = field(default_factory=dict)

    def all_requests(self) -> list[TraceRequest]:
        """This session's requests and its subagents', depth first."""
        out: list[TraceRequest] = []
        for req in self.requests:
            out.append(req)
            for child in self.children.get(req.turn, []):
                out.extend(child.all_requests())
        return out


def build_trees(requests: list[TraceRequest]) -> list[Session]:
    """Group requests into sessions and sessions into trees; roots in first-seen order."""
    sessions: dict[str, Session] = {}
    for req in requests:
        sessions.setdefault(req.session_id, Session(req.session_id)).requests.append(req)
    roots: list[Session] = []
    for sess in sessions.values():
        sess.requests.sort(key=lambda r: r.turn)
        parent = sess.requests[0].parent
        if parent is None:
            roots.append(sess)
        elif parent[0] in sessions:
            sessions[parent[0]].children.setdefault(parent[1], []).append(sess)
        else:
            raise ValueError(f"session {sess.session_id!r} names a missing parent {parent[0]!r}")
    return roots


def write_trace(path: str | Path, trees: list[Session]) -> None:
    """Write every request of `trees` as JSONL."""
    with open(path, "w") as f:
        for tree in trees:
            for req in tree.all_requests():
                f.write(json.dumps(req.to_json()) + "\n")


def read_trace(path: str | Path) -> list[Session]:
    """Read a JSONL trace into session trees."""
    reqs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    reqs.append(TraceRequest.from_json(json.loads(line)))
                except (KeyError, ValueError, TypeError) as exc:
                    raise ValueError(f"{path}:{n}: bad trace line: {exc}") from exc
    return build_trees(reqs)
