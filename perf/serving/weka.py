"""AIPerf's Weka trace format, read and written: the format of SemiAnalysis' AgentX corpus
(cc-traces-weka, replayed by `aiperf profile --scenario inferencex-agentx-mvp`).

One trace is one session tree, a JSON object (field names as AIPerf's loader validates them):

    {"id": "trace_0", "models": ["agent"], "block_size": 64, "hash_id_scope": "local",
     "tool_tokens": 0, "system_tokens": 230,
     "requests": [
       {"t": 0.0, "type": "n", "model": "agent", "in": 256, "out": 41, "hash_ids": [1, 2, 3, 4],
        "input_types": ["text"], "output_types": ["thinking", "tool_use"], "stop": "tool_use",
        "think_time": 0.0},
       {"type": "subagent", "t": 1.2, "agent_id": "agent_000", "subagent_type": "general",
        "status": "completed", "models": ["agent"], "requests": [{"type": "n", ...}], ...},
       {"t": 3.4, "type": "n", ..., "input_types": ["tool_result"], "think_time": 0.8}]}

`in` / `out` are prompt and completion tokens; `hash_ids` one id per `block_size` tokens of the
prompt, scoped to the trace; `think_time` the client's pause before the request (seconds);
`t` the request's start. A `subagent` entry runs after the parent request before it and the
parent's next request waits for it (AIPerf drops a subagent with no parent request before it,
and so does this reader). Streaming requests (`"type": "s"`) read like normal ones.

Files: a `.jsonl` holds one trace per line (what `ringserve bench gen-trace --format weka`
writes; the example perf/traces/agentx_example.jsonl is one); a `.json` file holds one trace; a
directory holds one `.json` per trace (what AIPerf's `--custom-dataset-type weka_trace
--input-file DIR` reads; `--format weka-dir` writes it).

The example (synthetic: 8 trees, 57 requests, sized for the tiny test model's 1024-token context
with room for the chat format's markup) was written by

    ringserve bench gen-trace --url unused --format weka --out perf/traces/agentx_example.jsonl \
        --num-sessions 8 --turns 3,8 --first-turn-tokens 128,256 --append-tokens 16,64 --max-context 448 \
        --short-output 8,24 --long-output 32,96 --think-s 0.05,0.5 --fork-prob 0.15 --subagent-turns 1,3 \
        --subagent-first-tokens 64,128 --seed 0

Delays: a request's pause is its `think_time`, else the idle gap since the previous request of
its session ended (`t` − previous `t` − previous `api_time`), as AIPerf's replay computes it. The
writer records no `api_time`, and sets each `t` to the previous request's `t` plus the think time
(plus a forked subagent's span), so both readings agree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from perf.serving.trace import Session, TraceRequest, read_trace

MODEL = "agent"


def looks_like_weka(path: str | Path) -> bool:
    """True for a directory, a .json file, or JSONL whose first object has Weka's `requests`."""
    p = Path(path)
    if p.is_dir() or p.suffix == ".json":
        return True
    with open(p) as f:
        for line in f:
            if line.strip():
                try:
                    first = json.loads(line)
                except ValueError:
                    return False
                return isinstance(first, dict) and "requests" in first
    return False


def _trace_objects(path: Path) -> list[tuple[str, dict]]:
    """(where, trace object) for every trace in a file or directory."""
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise ValueError(f"{path}: no .json trace files")
        return [(str(f), _load_json(f)) for f in files]
    if path.suffix == ".json":
        return [(str(path), _load_json(path))]
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append((f"{path}:{n}", json.loads(line)))
                except ValueError as exc:
                    raise ValueError(f"{path}:{n}: bad JSON: {exc}") from exc
    return out


def _load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: bad JSON: {exc}") from exc


def _delay_ms(req: dict, prev: dict | None) -> float:
    if req.get("think_time") is not None:
        return max(0.0, float(req["think_time"])) * 1000.0
    if prev is None:
        return 0.0
    gap = float(req["t"]) - float(prev["t"]) - float(prev.get("api_time") or 0.0)
    return max(0.0, gap) * 1000.0


def _request(sid: str, turn: int, req: dict, prev: dict | None, parent: tuple[str, int] | None,
             system_tokens: int) -> TraceRequest:
    return TraceRequest(sid, turn, int(req["in"]), max(1, int(req["out"])), [int(h) for h in req.get("hash_ids", [])],
                        _delay_ms(req, prev), parent, str(req.get("stop") or ""),
                        tuple(str(x) for x in req.get("input_types") or ()),
                        tuple(str(x) for x in req.get("output_types") or ()), system_tokens)


def _session(sid: str, requests: list[dict], parent: tuple[str, int] | None, system_tokens: int,
             spawn_t: float | None = None) -> Session:
    """A session from its requests; a subagent's first pause without `think_time` runs from its spawn."""
    sess = Session(sid)
    prev = None
    for turn, req in enumerate(requests):
        sess.requests.append(_request(sid, turn, req, prev, parent, system_tokens))
        if prev is None and spawn_t is not None and req.get("think_time") is None:
            t = float(req["t"])
            sess.requests[-1].delay_ms = 1000.0 * (t - spawn_t if t >= spawn_t else t)  # older captures: relative t
        prev = req
    return sess


def trace_to_tree(obj: dict[str, Any], where: str = "trace") -> tuple[Session, int]:
    """One Weka trace as a session tree, and its block size."""
    try:
        tid = str(obj["id"])
        block_size = int(obj["block_size"])
        root_sys = int(obj.get("system_tokens") or 0) + int(obj.get("tool_tokens") or 0)
        normals: list[dict] = []
        forks: dict[int, list[dict]] = {}
        for entry in obj["requests"]:
            kind = entry.get("type")
            if kind in ("n", "s"):
                normals.append(entry)
            elif kind == "subagent":
                if normals:  # AIPerf drops a subagent no parent request precedes
                    forks.setdefault(len(normals) - 1, []).append(entry)
            else:
                raise ValueError(f"request type {kind!r} is not n, s or subagent")
        if not normals:
            raise ValueError("no top-level requests")
        root = _session(tid, normals, None, root_sys)
        for turn, entries in forks.items():
            root.children[turn] = [
                _session(f"{tid}::sa:{e['agent_id']}", [r for r in e["requests"] if r.get("type") in ("n", "s")],
                         (tid, turn), int(e.get("system_tokens") or 0) + int(e.get("tool_tokens") or 0),
                         float(e["t"]))
                for e in entries if e.get("requests")]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: bad Weka trace: {exc!r}") from exc
    return root, block_size


def read_weka(path: str | Path) -> tuple[list[Session], int]:
    """Every trace under `path` as a session tree, and their (common) block size."""
    trees, sizes = [], set()
    for where, obj in _trace_objects(Path(path)):
        tree, bs = trace_to_tree(obj, where)
        trees.append(tree)
        sizes.add(bs)
    if len(sizes) > 1:
        raise ValueError(f"{path}: traces use different block sizes {sorted(sizes)}")
    return trees, sizes.pop()


def read_any(path: str | Path) -> tuple[list[Session], int | None, str]:
    """Trees from a Weka trace or a flat per-request trace: (trees, block size if known, format)."""
    if looks_like_weka(path):
        trees, bs = read_weka(path)
        return trees, bs, "weka"
    return read_trace(path), None, "flat"


# ---- writing -------------------------------------------------------------------------------------------


def _wire_request(req: TraceRequest, t: float) -> dict:
    return {"t": round(t, 3), "type": "n", "model": MODEL, "in": req.input_length, "out": req.output_length,
            "hash_ids": list(req.hash_ids), "input_types": list(req.input_types) or ["text"],
            "output_types": list(req.output_types) or ["text"], "stop": req.stop,
            "think_time": round(req.delay_ms / 1000.0, 3)}


def _child_entry(child: Session, index: int, start: float) -> tuple[dict, float]:
    """A subagent entry and the time its last request starts."""
    t = start
    reqs = []
    for req in child.requests:
        t += req.delay_ms / 1000.0
        reqs.append(_wire_request(req, t))
    entry = {"t": round(start, 3), "type": "subagent", "agent_id": f"agent_{index:03d}", "subagent_type": "general",
             "duration_ms": int(round((t - start) * 1000.0)),
             "total_tokens": sum(r.input_length + r.output_length for r in child.requests),
             "tool_use_count": sum(1 for r in child.requests if r.stop == "tool_use"), "status": "completed",
             "requests": reqs, "models": [MODEL], "tool_tokens": 0,
             "system_tokens": child.requests[0].system_tokens if child.requests else 0}
    return entry, t


def tree_to_trace(tree: Session, block_size: int) -> dict:
    """A session tree as one Weka trace (subagents one level deep, as the format has them)."""
    requests: list[dict] = []
    t = 0.0
    n_sub = 0
    for req in tree.requests:
        t += req.delay_ms / 1000.0
        requests.append(_wire_request(req, t))
        span_end = t
        for child in tree.children.get(req.turn, []):
            if child.children:
                raise ValueError(f"session {child.session_id!r}: the Weka format has no nested subagents")
            entry, end = _child_entry(child, n_sub, t)
            requests.append(entry)
            n_sub += 1
            span_end = max(span_end, end)
        t = span_end
    return {"id": f"trace_{tree.session_id}", "models": [MODEL], "block_size": block_size, "hash_id_scope": "local",
            "tool_tokens": 0, "system_tokens": tree.requests[0].system_tokens if tree.requests else 0,
            "requests": requests}


def write_weka(path: str | Path, trees: list[Session], block_size: int, as_dir: bool = False) -> None:
    """Write `trees` as Weka JSONL (one trace per line), or as a directory of per-trace .json files."""
    traces = [tree_to_trace(t, block_size) for t in trees]
    p = Path(path)
    if as_dir:
        p.mkdir(parents=True, exist_ok=True)
        for i, trace in enumerate(traces):
            (p / f"trace_{i:04d}.json").write_text(json.dumps(trace) + "\n")
        return
    with open(p, "w") as f:
        for trace in traces:
            f.write(json.dumps(trace) + "\n")
