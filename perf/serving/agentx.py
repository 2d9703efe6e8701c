"""Synthetic AgentX-like sessions (anchors.md §3.4), deterministic for a seed.

Each top-level session has T turns (log-uniform in `turns`). Turn 0's prompt is the system
prompt and tools (`first_turn_tokens`, log-uniform); each later turn's prompt is the previous
prompt + the previous output + a tool output (`append_tokens`, log-normal), i.e. the full
history grows. When prompt + output would exceed `max_context` the session compacts: the history
restarts from the turn-0 prefix (same blocks, so they stay cache hits) plus the new tool output.
Outputs are bimodal: with probability `long_share` from `long_output`, else from `short_output`
(log-uniform within each range). Think time before each turn is log-normal in `think_s`. After
a non-final turn, with probability `fork_prob`, 1..`max_subagents` subagents start, each a short
session (`subagent_turns`, `subagent_first_tokens`) with its own context; the parent's next turn
waits for them.

Message shape (read by the `agentx` request shape, perf/serving/conversation.py): the first
`system_share` of a session's turn-0 prompt is its system prompt and tools; a non-final turn's
reply ends in a tool call with probability `tool_use_share` (then the next turn's new input is
the tool's result), else it ends the turn (the next input is a user message); a reply opens with
a reasoning section with probability `thinking_share`. These draws come from their own random
stream, so the lengths, hashes and times above do not depend on them.

"Log-normal in (lo, hi)": median sqrt(lo·hi), 90% of mass inside (lo, hi), clipped to it.
Blocks: every `block_size` tokens of history get a fresh hash id when filled; extending a partial
last block replaces its id (its content changed), so the ideal prefix-hit rate follows from ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from perf.serving.trace import Session, TraceRequest

Range = tuple[float, float]


@dataclass(frozen=True, slots=True)
class AgentXParams:
    """Every size of the generator; defaults are the CPU scale, `GPU_SHAPE` the §3.4 shape."""

    num_sessions: int = 8
    turns: Range = (3, 8)
    first_turn_tokens: Range = (256, 1024)
    append_tokens: Range = (32, 256)
    max_context: int = 2048
    short_output: Range = (8, 32)
    long_output: Range = (64, 256)
    long_share: float = 0.3
    think_s: Range = (0.05, 1.0)
    fork_prob: float = 0.1
    max_subagents: int = 4
    subagent_turns: Range = (1, 3)
    subagent_first_tokens: Range = (64, 256)
    block_size: int = 64
    tool_use_share: float = 0.7
    thinking_share: float = 1.0
    system_share: float = 0.9
    seed: int = 0


GPU_SHAPE = AgentXParams(
    num_sessions=256, turns=(20, 300), first_turn_tokens=(6000, 20000), append_tokens=(200, 8000),
    max_context=131072, short_output=(15, 200), long_output=(300, 3000), think_s=(0.5, 30.0),
    subagent_turns=(2, 10), subagent_first_tokens=(1000, 4000))

PRESETS = {"cpu": AgentXParams(), "gpu": GPU_SHAPE}


def log_uniform(rng: np.random.Generator, r: Range) -> float:
    lo, hi = float(r[0]), float(r[1])
    return lo if hi <= lo else math.exp(rng.uniform(math.log(lo), math.log(hi)))


def log_normal(rng: np.random.Generator, r: Range) -> float:
    lo, hi = float(r[0]), float(r[1])
    if hi <= lo:
        return lo
    sigma = math.log(hi / lo) / (2 * 1.645)
    return float(np.clip(rng.lognormal(math.log(math.sqrt(lo * hi)), sigma), lo, hi))


class _History:
    """A session's prompt as token count + block hash ids."""

    def __init__(self, ids: "_Ids", block_size: int) -> None:
        self.ids, self.bs = ids, block_size
        self.length = 0
        self.hashes: list[int] = []

    def append(self, n: int) -> None:
        if n <= 0:
            return
        if self.length % self.bs:
            self.hashes[-1] = self.ids.next()  # the partial block's content changes
        self.length += n
        while len(self.hashes) < math.ceil(self.length / self.bs):
            self.hashes.append(self.ids.next())

    def reset_to(self, length: int, hashes: list[int]) -> None:
        self.length, self.hashes = length, list(hashes)


class _Ids:
    def __init__(self) -> None:
        self.n = 0

    def next(self) -> int:
        self.n += 1
        return self.n


def _output_len(rng: np.random.Generator, p: AgentXParams) -> int:
    r = p.long_output if rng.random() < p.long_share else p.short_output
    return max(1, round(log_uniform(rng, r)))


class _Shape:
    """The message-shape draws of one session tree (their own random stream)."""

    def __init__(self, rng: np.random.Generator, p: AgentXParams) -> None:
        self.rng, self.p = rng, p

    def stop(self, last: bool) -> str:
        return "end_turn" if last or self.rng.random() >= self.p.tool_use_share else "tool_use"

    def output_types(self, stop: str) -> tuple[str, ...]:
        body = "tool_use" if stop == "tool_use" else "text"
        return ("thinking", body) if self.rng.random() < self.p.thinking_share else (body,)


def _session(rng: np.random.Generator, p: AgentXParams, sid: str, n_turns: int, first: Range,
             parent: tuple[str, int] | None, ids: _Ids, fork: bool, shape: _Shape) -> Session:
    sess = Session(sid)
    hist = _History(ids, p.block_size)
    hist.append(min(round(log_uniform(rng, first)), p.max_context - 1))
    base = (hist.length, list(hist.hashes))
    system_tokens = int(base[0] * p.system_share)
    prev_out, prev_stop = 0, ""
    for turn in range(n_turns):
        out_len = _output_len(rng, p)
        if turn > 0:
            tool = max(1, round(log_normal(rng, p.append_tokens)))
            if hist.length + prev_out + tool + out_len > p.max_context:
                hist.reset_to(*base)
                prev_out = 0
            hist.append(prev_out)
            hist.append(tool)
        out_len = max(1, min(out_len, p.max_context - hist.length))
        delay = 0.0 if (turn == 0 and parent is None) else log_normal(rng, p.think_s) * 1000.0
        stop = shape.stop(turn == n_turns - 1)
        in_types = ("tool_result",) if prev_stop == "tool_use" else ("text",)
        sess.requests.append(TraceRequest(sid, turn, hist.length, out_len, list(hist.hashes), delay, parent, stop,
                                          in_types, shape.output_types(stop), system_tokens))
        prev_out, prev_stop = out_len, stop
        if fork and turn < n_turns - 1 and rng.random() < p.fork_prob:
            k = int(rng.integers(1, p.max_subagents + 1))
            sess.children[turn] = [
                _session(rng, p, f"{sid}.{turn}.{j}", max(1, round(log_uniform(rng, p.subagent_turns))),
                         p.subagent_first_tokens, (sid, turn), ids, False, shape)
                for j in range(k)]
    return sess


def generate(p: AgentXParams) -> list[Session]:
    """`p.num_sessions` session trees; tree i depends only on (seed, i)."""
    trees = []
    for i in range(p.num_sessions):
        rng = np.random.default_rng([p.seed, i])
        n_turns = max(1, round(log_uniform(rng, p.turns)))
        shape = _Shape(np.random.default_rng([p.seed, i, 2]), p)
        trees.append(_session(rng, p, str(i), n_turns, p.first_turn_tokens, None, _Ids(), True, shape))
    return trees


def params_from(preset: str, **overrides) -> AgentXParams:
    """A preset with the non-None overrides applied."""
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
