"""What the scheduler hands the model runner for one step, and what the runner hands back.

`Batch` is read-only to the runner; `StepOutput` is the runner's whole answer. The scheduler
alone turns that answer into request state (tokens, drafts, counters, finishes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step
    num_tokens: int  # positions [start, start + num_tokens)
    num_draft: int  # trailing draft tokens among them (verification)
    # Whether this step computes every known (and draft) token, so a new token is sampled.
    # Fixed when scheduled: the update appends tokens afterwards.
    reaches_end: bool
    # Async scheduling: trailing tokens that the step in flight produces (not on the host yet;
    # the runner takes them from that step's device results): 1 for the token it samples, plus,
    # with speculation, the drafts it proposes (then every token of this step is one).
    num_placeholder: int = 0
    # Async scheduling with speculation: the step in flight verifies `shift` drafts, and how many
    # it accepts is known on the device only. This step's positions are then
    # [start + a, end + a) for that count a ∈ [0, shift]: `start` is the earliest.
    shift: int = 0
    # A plain greedy decode (num_tokens 1): positions past `end` that the same call may decode
    # too, each step's input the argmax of the step before (the CPU's compiled step; the runner
    # may run fewer). Their KV blocks are allocated; the output's tokens say how many it ran.
    lookahead: int = 0

    @property
    def end(self) -> int:
        """The end of the step's positions (the earliest, when it is shifted)."""
        return self.start + self.num_tokens

    @property
    def max_end(self) -> int:
        """The latest end the step's positions can reach (what its KV blocks must cover)."""
        return self.start + self.num_tokens + self.shift + self.lookahead

    def token_ids(self) -> list[int]:
        """Token ids at positions [start, end): known tokens, then the trailing drafts (or a 0
        standing for the placeholder)."""
        req = self.request
        known = len(req.token_ids)
        tokens = req.token_ids[self.start : self.end]
        if self.num_placeholder:
            return tokens + [0] * (self.num_tokens - len(tokens))
        if self.end > known:  # verification
            tokens = tokens + req.draft_token_ids[max(0, self.start - known) : self.end - known]
        return tokens


@dataclass
class Batch:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def uniform_decode(self) -> int | None:
        """q when every sequence computes exactly its last q tokens (decode: 1, verify: 1 + drafts),
        the steps the static-shape path can run; else None."""
        if not self.scheduled:
            return None
        q = self.scheduled[0].num_tokens
        if all(s.reaches_end and s.num_tokens == q and s.num_draft == q - 1 for s in self.scheduled):
            return q
        return None

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass(slots=True)
class RequestStepOutput:
    """What one request that reached its end this step produced."""

    accepted: list[int]  # verified drafts, then the newly sampled (bonus or recovered) token
    logprobs: list[float] | None = None  # one per accepted token
    top_logprobs: list[list[tuple[int, float]]] | None = None
    drafts: list[int] = field(default_factory=list)  # proposals for the next step
    draft_probs: torch.Tensor | None = None  # [len(drafts), V] for sampled drafts; None = one-hot
    error: str | None = None


@dataclass(slots=True)
class PromptScores:
    """Scores of prompt tokens first … first + len − 1 computed this step (prompt_logprobs requests)."""

    first: int  # index in the prompt of the first scored token (≥ 1)
    logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[list[tuple[int, float]]]


@dataclass(slots=True)
class StepOutput:
    """The runner's result: one entry per request that reached its end (request id → output)."""

    outputs: dict[int, RequestStepOutput] = field(default_factory=dict)
    prompt_scores: dict[int, PromptScores] = field(default_factory=dict)  # request id → this step's prompt rows
