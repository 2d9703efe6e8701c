"""Continuous batching: which requests compute how many tokens this step.

Interface: `add`, `abort`, `schedule() -> Batch`, `update(batch, output) -> finished requests`.
Running requests go first (oldest first), then waiting ones, under a token budget
(`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`). When KV blocks run out the
newest running request is preempted: its blocks are freed and it is recomputed later. No CUDA
here; the scheduler is tested with hand-made step outputs.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from .kv_cache import KVCache
from .request import FinishReason, Request, RequestError, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be ≥ 1")
        if self.max_num_batched_tokens < self.num_speculative_tokens + 1:
            raise ValueError("max_num_batched_tokens must hold one verify step (speculative tokens + 1)")


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step
    num_tokens: int  # positions [start, start + num_tokens)
    num_draft: int  # trailing draft tokens among them (verification)
    # Whether this step computes every known (and draft) token, so a new token is sampled.
    # Fixed when scheduled: the update appends tokens afterwards.
    reaches_end: bool


@dataclass
class Batch:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass(slots=True)
class RequestStepOutput:
    """What the model runner produced for one request that reached its end this step."""

    accepted: list[int]  # verified drafts, then the newly sampled (bonus or recovered) token
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    drafts: list[int] = field(default_factory=list)  # proposals for the next step
    error: str | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: KVCache, eos_token_ids: tuple[int, ...] = ()):
        self.config = config
        self.cache = cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- admission -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        limit = self.config.max_model_len
        if not req.prompt_token_ids:
            raise RequestError("the prompt is empty")
        if req.num_prompt_tokens + req.params.max_tokens > limit:
            raise RequestError(
                f"prompt ({req.num_prompt_tokens} tokens) plus max_tokens ({req.params.max_tokens}) exceeds the "
                f"model's context length ({limit} tokens)")
        if req.request_id in self.requests:
            raise RequestError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request in any state and free everything it holds."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self._finish(req, FinishReason.ABORT)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ------------------------------------------------------------------------
    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        allocate = self.cache.manager.allocate
        scheduled = batch.scheduled
        i = 0
        # The hot loop of steady decode (hundreds of requests per step): kept to plain arithmetic.
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            known = len(req.token_ids)
            total = known + len(req.draft_token_ids)
            start = req.num_computed_tokens
            n = min(total - start, budget)
            if not allocate(req.seq.table, start, start + n) and not self._preempt_until_fits(req, n, batch):
                break  # req itself was preempted; everything after it was too
            scheduled.append(ScheduledRequest(req, start, n, max(0, start + n - known), start + n == total))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not batch.preempted:
            req = self.waiting[0]
            n = min(len(req.token_ids) - req.num_computed_tokens, budget)
            if req.seq is None:
                req.seq = self.cache.new_sequence()
            if not self.cache.allocate(req.seq, req.num_computed_tokens, req.num_computed_tokens + n):
                break  # wait for blocks to come back
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.scheduled.append(self._scheduled(req, n))
            budget -= n
        return batch

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        known = len(req.token_ids)
        return ScheduledRequest(req, start, n, max(0, start + n - known), start + n == known + len(req.draft_token_ids))

    def _preempt_until_fits(self, req: Request, n: int, batch: Batch) -> bool:
        """Preempt the newest running requests until `req`'s next n tokens fit; False if req itself went."""
        start = req.num_computed_tokens
        while not self.cache.allocate(req.seq, start, start + n):
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Free the request's blocks; it is recomputed from scratch when blocks return."""
        self._release(req)
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.info("preempted request %s (%d tokens known)", req.request_id, len(req.token_ids))

    # ---- results ---------------------------------------------------------------------------
    def update(self, batch: Batch, outputs: dict[str, RequestStepOutput]) -> list[Request]:
        """Advance counters, append accepted tokens, apply stop rules; returns finished requests."""
        finished = []
        for s in batch.scheduled:
            req = s.request
            if req.is_finished:  # aborted while the step ran
                continue
            req.num_computed_tokens = s.start + s.num_tokens
            if not s.reaches_end:
                continue
            out = outputs[req.request_id]
            if out.error is not None:
                req.error = out.error
                self._finish_running(req, FinishReason.ERROR)
                finished.append(req)
                continue
            rejected = s.num_draft - (len(out.accepted) - 1)
            req.num_computed_tokens -= rejected
            req.draft_token_ids = []
            reason = self._append(req, out)
            if reason is not None:
                self._finish_running(req, reason)
                finished.append(req)
            else:
                req.draft_token_ids = list(out.drafts)
        return finished

    def _append(self, req: Request, out: RequestStepOutput) -> FinishReason | None:
        p = req.params
        for j, token in enumerate(out.accepted):
            req.token_ids.append(token)
            if out.logprobs is not None:
                req.logprobs.append(out.logprobs[j])
                req.top_logprobs.append(out.top_logprobs[j] if out.top_logprobs else [])
            if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
                return FinishReason.STOP
            if req.num_output_tokens >= p.max_tokens:
                return FinishReason.LENGTH
        return None

    def _finish_running(self, req: Request, reason: FinishReason) -> None:
        self.running.remove(req)
        self._finish(req, reason)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.draft_token_ids = []
        self._release(req)
        self.requests.pop(req.request_id, None)

    def _release(self, req: Request) -> None:
        if req.seq is not None:
            self.cache.free(req.seq)
        if req.mtp_seq is not None:
            req.mtp_seq.num_tokens = 0  # shares the main table, already freed
