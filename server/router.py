"""Data-parallel request routing by token load, not request count.

A rank's load is the work it still owes, in tokens:
    queued prefill tokens (prompts not yet started)
  + live KV tokens (blocks in use × block size, from its heartbeats)
  + expected decode tokens (per request: min(max_tokens, 2 × the running mean output length))
A new request goes to the alive rank with the least load, except that a request carrying a
session (or user) id sticks to the rank that served that session before, so its prefix can be
reused there. `imbalance()` is max/mean load over alive ranks (1.0 = perfectly even).

A cached prefix counts: a session's request that returns to the rank holding its previous
prompt owes prefill only for what that rank is not expected to have cached, i.e. its prompt
minus the full blocks of the previous prompt (the engine's prefix cache keeps those blocks
unless memory pressure evicted them, so this is an estimate, not a promise).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class NoRankAlive(RuntimeError):
    """Every rank is dead: nothing can take a request until the server restarts."""


@dataclass
class _Owed:
    prefill: int
    decode: int


@dataclass
class RankLoad:
    alive: bool = True
    kv_tokens: int = 0
    owed: dict[int, _Owed] = field(default_factory=dict)  # request id → what it still costs

    @property
    def queued_prefill(self) -> int:
        return sum(o.prefill for o in self.owed.values())

    @property
    def expected_decode(self) -> int:
        return sum(o.decode for o in self.owed.values())

    @property
    def load(self) -> int:
        return self.queued_prefill + self.kv_tokens + self.expected_decode


class DPRouter:
    POLICIES = ("token_load", "round_robin")

    def __init__(self, num_ranks: int, block_size: int = 256, max_sessions: int = 100_000,
                 policy: str = "token_load"):
        if num_ranks < 1:
            raise ValueError("need at least one rank")
        if policy not in self.POLICIES:
            raise ValueError(f"routing policy must be one of {self.POLICIES}, got {policy!r}")
        self.policy = policy
        self._turn = 0
        self.ranks = [RankLoad() for _ in range(num_ranks)]
        self.block_size = block_size
        self.sessions: dict[str, int] = {}
        self._session_prompt: dict[str, int] = {}  # session → prompt tokens of its last request
        self.max_sessions = max_sessions
        self._mean_output = 128.0  # running mean of completion lengths (EWMA)
        self._where: dict[int, int] = {}  # request id → rank

    # ---- routing ---------------------------------------------------------------------------
    def pick(self, session: str | None = None) -> int:
        alive = [i for i, r in enumerate(self.ranks) if r.alive]
        if not alive:
            raise NoRankAlive("no worker is alive")
        if session is not None:
            rank = self.sessions.get(session)
            if rank is not None and self.ranks[rank].alive:
                return rank
        if self.policy == "round_robin":  # the baseline the benchmark compares against
            self._turn += 1
            return alive[self._turn % len(alive)]
        return min(alive, key=lambda i: (self.ranks[i].load, i))

    def assign(self, request_id: int, prompt_tokens: int, max_tokens: int, session: str | None = None) -> int:
        """Pick a rank for a new request and account for its work there."""
        rank = self.pick(session)
        expected = int(min(max_tokens, 2 * self._mean_output))
        prefill = prompt_tokens - self.cached_estimate(session, rank, prompt_tokens)
        self.ranks[rank].owed[request_id] = _Owed(prefill, expected)
        self._where[request_id] = rank
        if session is not None:
            if len(self.sessions) >= self.max_sessions and session not in self.sessions:
                old = next(iter(self.sessions))  # forget the oldest session
                self.sessions.pop(old)
                self._session_prompt.pop(old, None)
            self.sessions[session] = rank
            self._session_prompt[session] = prompt_tokens
        return rank

    def cached_estimate(self, session: str | None, rank: int, prompt_tokens: int) -> int:
        """Prompt tokens `rank` likely holds in its prefix cache for this session's next request:
        the full blocks of the session's previous prompt there (never the whole prompt: the last
        token is always computed)."""
        if session is None or self.sessions.get(session) != rank:
            return 0
        prev = self._session_prompt.get(session, 0)
        return min(prev, prompt_tokens - 1) // self.block_size * self.block_size

    # ---- feedback --------------------------------------------------------------------------
    def on_tokens(self, request_id: int, num_tokens: int) -> None:
        """The request produced tokens: its prompt is in KV now, and less decode is owed."""
        rank = self._where.get(request_id)
        if rank is None:
            return
        owed = self.ranks[rank].owed[request_id]
        owed.prefill = 0
        owed.decode = max(0, owed.decode - num_tokens)

    def on_finish(self, request_id: int, completion_tokens: int | None = None) -> None:
        rank = self._where.pop(request_id, None)
        if rank is not None:
            self.ranks[rank].owed.pop(request_id, None)
        if completion_tokens is not None:
            self._mean_output += 0.05 * (completion_tokens - self._mean_output)

    def on_heartbeat(self, rank: int, kv_blocks_used: int) -> None:
        self.ranks[rank].kv_tokens = kv_blocks_used * self.block_size

    def mark_dead(self, rank: int) -> list[int]:
        """Take a rank out of rotation; returns the request ids that were on it."""
        r = self.ranks[rank]
        r.alive = False
        lost = list(r.owed)
        for rid in lost:
            self._where.pop(rid, None)
        r.owed.clear()
        r.kv_tokens = 0
        for s in [s for s, k in self.sessions.items() if k == rank]:
            del self.sessions[s]
            self._session_prompt.pop(s, None)
        return lost

    # ---- metrics ---------------------------------------------------------------------------
    def loads(self) -> list[int]:
        return [r.load for r in self.ranks if r.alive]

    def imbalance(self) -> float:
        loads = self.loads()
        mean = sum(loads) / len(loads) if loads else 0.0
        return max(loads) / mean if mean > 0 else 1.0
