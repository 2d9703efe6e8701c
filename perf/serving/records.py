"""What the client sends (`RequestSpec`) and what it measures (`RequestRecord`).

All times are `time.perf_counter()` seconds. A request moves through three instants before its
first token: `ready_s` (the arrival schedule or the session's think time says it may go),
`send_s` (a concurrency slot was free and the HTTP request was written) and `first_token_s`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestSpec:
    """One request of a workload.

    `prompt` is the user text (chat endpoint: one user message; completions endpoint: the raw
    prompt), unless `messages` gives the whole chat history (the agentx request shape).
    `input_length` is the workload's nominal prompt length in tokens (the server's
    `usage.prompt_tokens` replaces it when present). `hash_ids` are the prompt's 64-token block
    hashes, already salted per session tree, used for the ideal prefix-hit rate. `headers` are
    sent with the request (session affinity); `max_tokens_field` names the output limit.
    """

    prompt: str
    max_tokens: int
    input_length: int
    session_id: str | None = None
    turn: int = 0
    hash_ids: tuple[int, ...] = ()
    extra_body: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    max_tokens_field: str = "max_tokens"


@dataclass(slots=True)
class RequestRecord:
    """Timings and token counts of one finished (or failed) request.

    `chunk_times[i]` is the arrival time of the i-th token-carrying chunk and `chunk_tokens[i]`
    its token count; `chunk_tokens_exact` is True when every count came from the server
    (per-chunk usage or logprobs) rather than the one-token-per-chunk assumption.
    `cached_tokens` (`usage.prompt_tokens_details.cached_tokens`: the server's prefix-cache hit)
    and `reasoning_tokens` (`usage.completion_tokens_details.reasoning_tokens`) are None when the
    server's usage does not carry them.
    """

    spec: RequestSpec
    ready_s: float = 0.0
    send_s: float = 0.0
    first_token_s: float | None = None
    end_s: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    chunk_tokens_exact: bool = True
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    ok: bool = False
    error: str = ""

    @property
    def input_tokens(self) -> int:
        """Server-reported prompt tokens, else the workload's nominal length."""
        return self.prompt_tokens if self.prompt_tokens is not None else self.spec.input_length

    @property
    def output_tokens(self) -> int:
        """Server-reported completion tokens, else the counted chunk tokens."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return sum(self.chunk_tokens)

    @property
    def queue_s(self) -> float:
        """Time spent waiting for a client-side concurrency slot."""
        return max(0.0, self.send_s - self.ready_s)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, measured from send (excludes the client-side slot wait)."""
        return None if self.first_token_s is None else self.first_token_s - self.send_s

    @property
    def e2el_s(self) -> float:
        """End-to-end latency from send to the end of the stream."""
        return self.end_s - self.send_s
