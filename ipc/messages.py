"""Messages between the server and workers: frozen, slotted dataclasses, each with a one-byte tag.

Direction: server -> worker: Submit, Abort, Shutdown. Worker -> server: WorkerReady, Heartbeat,
TokenDelta, Finished, Error. The wire format lives in ``ipc.codec``; these classes hold plain values
only (ints, floats, str, lists), never objects with behaviour.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

TopLogprobs = list[list[tuple[int, float]]]  # per generated token: [(token_id, logprob), ...]


@dataclass(frozen=True, slots=True)
class SamplingParamsMsg:
    """Sampling parameters as sent to a worker (already validated by the server)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token; None: no logprobs
    session_id: str | None = None  # affinity key for prefix reuse


@dataclass(frozen=True, slots=True)
class Submit:
    """A new request with its full prompt (sent once; later traffic is deltas)."""

    TAG: ClassVar[int] = 1
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParamsMsg


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop a request (client gone, deadline passed); the worker frees its slots and KV blocks."""

    TAG: ClassVar[int] = 2
    request_id: int


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """Tokens generated for one request since its last delta."""

    TAG: ClassVar[int] = 3
    request_id: int
    token_ids: list[int]
    logprobs: list[float] | None = None  # one per token in token_ids
    top_logprobs: TopLogprobs | None = None  # one list per token in token_ids


@dataclass(frozen=True, slots=True)
class Finished:
    """A request ended; ``reason`` is "stop", "length", "abort" or "error"."""

    TAG: ClassVar[int] = 4
    request_id: int
    reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Error:
    """A request failed in the worker; ``code`` is an HTTP-style status the server may reuse."""

    TAG: ClassVar[int] = 5
    request_id: int
    message: str
    code: int


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """A worker finished loading and warming up and can take requests."""

    TAG: ClassVar[int] = 6
    rank: int
    pid: int
    num_kv_blocks: int
    kv_block_size: int = 256  # tokens per KV block
    max_model_len: int = 0
    device: str = ""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Worker liveness and load, sent every step and when idle; times are time.time() seconds."""

    TAG: ClassVar[int] = 7
    rank: int
    step: int
    step_started_at: float
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int = 0
    sent_at: float = 0.0
    # Cumulative engine counters since the worker started (the server turns them into metrics).
    num_preemptions: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    loop_pause_max_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Ask a worker to stop (server side) or announce that it stops (worker side)."""

    TAG: ClassVar[int] = 8
    reason: str


Message = Submit | Abort | TokenDelta | Finished | Error | WorkerReady | Heartbeat | Shutdown
MESSAGE_TYPES: tuple[type, ...] = (Submit, Abort, TokenDelta, Finished, Error, WorkerReady, Heartbeat, Shutdown)
assert len({t.TAG for t in MESSAGE_TYPES}) == len(MESSAGE_TYPES)
