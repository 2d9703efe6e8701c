"""Continuous batching: which requests compute how many tokens this step, and what they got.

Interface: `add`, `abort`, `schedule() -> Batch`, `update(batch, StepOutput) -> (deltas,
finishes)`. Running requests go first (oldest first), then waiting ones, under a token budget
(`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`). When KV blocks run out the
newest running request is preempted: its blocks are freed and it is recomputed later. With a
prefix cache (engine/prefix_cache.py) an admitted request starts on the cached blocks of its
longest cached prefix, and every step's completed blocks become cached for later requests
(a preempted request usually resumes from its own). The scheduler is the only writer of
request state. No CUDA here; it is tested with hand-made step outputs.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace

from ipc.messages import Finished, PromptLogprobs, TokenDelta

from .batch import Batch, ScheduledRequest, StepOutput
from .kv_cache import KVCache
from .prefix_cache import Hit, PrefixCache
from .request import FinishReason, Request, RequestError, RequestStatus
from .v41.vision.inputs import attach_to_sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    num_speculative_tokens: int = 0
    # Greedy decode steps one call may run (the CPU's compiled step, engine/model_runner.py
    # `_greedy_steps`): a plain greedy decode gets KV blocks for up to this many positions.
    decode_steps: int = 1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be ≥ 1")
        if self.decode_steps < 1:
            raise ValueError("decode_steps must be ≥ 1")
        if self.max_num_batched_tokens < self.num_speculative_tokens + 1:
            raise ValueError("max_num_batched_tokens must hold one verify step (speculative tokens + 1)")


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: KVCache, eos_token_ids: tuple[int, ...] = (),
                 prefix_cache: PrefixCache | None = None):
        self.config = config
        self.cache = cache
        self.prefix = prefix_cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.num_preemptions = 0
        # Of config.decode_steps, how many the next call may run (the engine paces it by the
        # steps' time: Engine._pace_decode_steps).
        self.steps_per_call = config.decode_steps

    def allow_decode_steps(self, steps: int) -> None:
        """Let plain greedy decodes run up to `steps` steps per call (config.decode_steps)."""
        self.config = replace(self.config, decode_steps=steps)
        self.steps_per_call = steps

    # ---- admission -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        # Every entry point ran the edge validator (ipc/prompt_checks.py): a prompt that does not
        # fit here is a bug, not bad input.
        assert req.prompt_token_ids and req.num_prompt_tokens + req.params.max_tokens <= self.config.max_model_len, \
            f"request {req.request_id} was not validated: {req.num_prompt_tokens} + {req.params.max_tokens} tokens"
        if req.request_id in self.requests:
            raise RequestError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: int) -> Finished | None:
        """Finish a request in any state and free everything it holds; None if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        return self._finish(req, FinishReason.ABORT)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ------------------------------------------------------------------------
    def schedule(self, ahead: Batch | None = None, ahead_drafts: dict[int, int] | None = None) -> Batch:
        """The next step. `ahead` (async scheduling): the step in flight, not yet updated. A
        request in it continues from where that step ends; when that step samples its next
        token, the new step computes that token's position with a placeholder for it. With
        speculation, `ahead_drafts` (request id → drafts the step in flight proposes for it) is
        given: such a request's new step verifies those drafts, all placeholders, at positions
        shifted by however many of its current drafts the step in flight accepts (see
        `ScheduledRequest.shift`). Under `ahead` nothing is preempted: if blocks run out the
        batch is empty, and the engine completes the step in flight before scheduling again."""
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        allocate = self.cache.manager.allocate
        scheduled = batch.scheduled
        in_flight = {s.request.request_id: s for s in ahead.scheduled} if ahead else None
        if (ahead_drafts is not None and self.waiting and len(self.running) < self.config.max_num_seqs
                and any(s.reaches_end and s.num_draft for s in ahead.scheduled)):
            # A shifted step runs static decode shapes only, so no prefill joins it: a waiting
            # request that could be admitted makes this a synchronous step instead. (A step in
            # flight that verifies no drafts, e.g. adaptive speculation at a large batch, shifts
            # nothing, and admission goes on as without speculation.)
            return batch
        i = 0
        ahead_steps = self.steps_per_call - 1 if in_flight is None else 0
        # The hot loop of steady decode (hundreds of requests per step): kept to plain arithmetic.
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            known = len(req.token_ids)
            total = known + len(req.draft_token_ids)
            start = req.num_computed_tokens
            placeholder = shift = 0
            num_draft = -1  # from the positions (below) unless set here
            if in_flight is not None and (prev := in_flight.get(req.request_id)) is not None:
                if not _can_run_ahead(req, prev, ahead_drafts is not None):
                    i += 1
                    continue
                if prev.reaches_end and ahead_drafts is not None:
                    # req.num_computed_tokens is where prev really started (its predecessor is
                    # done), so only prev's own acceptance is unknown.
                    num_draft = ahead_drafts.get(req.request_id, 0)
                    start, shift = req.num_computed_tokens + prev.num_tokens - prev.num_draft, prev.num_draft
                    placeholder = 1 + num_draft
                    total = start + placeholder
                else:
                    start, placeholder = prev.end, int(prev.reaches_end)
                    total += placeholder
            n = min(total - start, budget)
            if shift and n < total - start:
                break  # a shifted step verifies all its drafts or waits
            look = self._lookahead(req, ahead_steps) if ahead_steps and n == 1 and start + 1 == total == known else 0
            if look and not allocate(req.seq.table, start, start + 1 + look, True):
                look = 0  # blocks for one step only: it decodes one token
            if not look and not allocate(req.seq.table, start, start + n + shift, True):
                if in_flight is not None:
                    return Batch()
                if not self._preempt_until_fits(req, n, batch):
                    break  # req itself was preempted; everything after it was too
            if num_draft < 0:
                num_draft = max(0, start + n - known - placeholder)
            scheduled.append(ScheduledRequest(req, start, n, num_draft, start + n == total, placeholder, shift, look))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not batch.preempted:
            req = self._next_waiting()
            if req is None:
                break  # only requests whose grammar is still compiling wait
            if req.seq is None:
                req.seq = self.cache.new_sequence()
                attach_to_sequence(req)  # its images' spans, read by the forward (DeepSeek-V4.1 vision)
            hit = self._adopt_prefix(req)
            start = req.num_computed_tokens
            n = min(len(req.token_ids) - start, budget)
            if not allocate(req.seq.table, start, start + n, True):
                if hit is not None:
                    self.prefix.undo(req)
                break  # wait for blocks to come back
            if self.prefix is not None:
                self.prefix.admitted(req, hit)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
                req.num_cached_tokens = req.num_computed_tokens  # what the prefix cache supplied
            self.running.append(req)
            batch.scheduled.append(self._scheduled(req, n))
            budget -= n
        return batch

    def _lookahead(self, req: Request, most: int) -> int:
        """Positions past this decode step that a call may also decode for `req` (≤ most): a
        plain greedy request (its next token the argmax, nothing else), within its max_tokens
        and the context limit."""
        p = req.params
        if not p.greedy or p.has_penalties or p.logprobs is not None or req.grammar is not None:
            return 0
        return max(0, min(most, p.max_tokens - req.num_output_tokens - 1,
                          self.config.max_model_len - len(req.token_ids) - 1))

    def _next_waiting(self) -> Request | None:
        """The oldest waiting request that can start: one whose grammar (structured outputs) is
        compiled and whose matcher is started; the others wait without holding the queue up."""
        for req in self.waiting:
            if req.grammar is None or req.grammar.matcher is not None:
                return req
        return None

    @property
    def waits_on_grammars_only(self) -> bool:
        """Nothing runs and every waiting request waits for its grammar's compile."""
        return not self.running and bool(self.waiting) and self._next_waiting() is None

    def finish_waiting(self, req: Request) -> Finished:
        """Finish a waiting request whose output is already complete (stop)."""
        self.waiting.remove(req)
        return self._finish(req, FinishReason.STOP)

    def fail_waiting(self, req: Request, error: str, error_code: int = 400) -> Finished:
        """Finish a waiting request that cannot run (its grammar did not compile)."""
        self.waiting.remove(req)
        req.error = error
        return self._finish(req, FinishReason.ERROR, error_code)

    def _adopt_prefix(self, req: Request) -> Hit | None:
        """Start a request that holds no blocks on its longest usable cached prefix."""
        if self.prefix is None or req.num_computed_tokens or req.seq.table.full:
            return None
        if req.params.prompt_logprobs is not None and not req.prompt_scores_sent:
            return None  # scoring needs the logits of every prompt position: compute them (as vLLM does)
        hit = self.prefix.match(req)
        if hit is not None:
            self.prefix.adopt(req, hit)
        return hit

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        known = len(req.token_ids)
        return ScheduledRequest(req, start, n, max(0, start + n - known), start + n == known + len(req.draft_token_ids))

    def _preempt_until_fits(self, req: Request, n: int, batch: Batch) -> bool:
        """Preempt the newest running requests until `req`'s next n tokens fit; False if req itself went."""
        start = req.num_computed_tokens
        while not self.cache.manager.allocate(req.seq.table, start, start + n, True):
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
        req.draft_probs = None
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.info("preempted request %s (%d tokens known)", req.request_id, len(req.token_ids))

    # ---- results ---------------------------------------------------------------------------
    def update(self, batch: Batch, step: StepOutput) -> tuple[list[TokenDelta], list[Finished]]:
        """Advance counters, append accepted tokens, apply stop rules. Returns the step's token
        deltas and the requests it finished (a request's last delta precedes its finish)."""
        deltas: list[TokenDelta] = []
        finished: list[Finished] = []
        outputs = step.outputs
        prefix = self.prefix
        for s in batch.scheduled:
            req = s.request
            if req.is_finished:  # aborted while the step ran
                continue
            # a shifted step starts where the update of the step before it left the request
            req.num_computed_tokens = req.num_computed_tokens + s.num_tokens if s.shift else s.end
            scores = step.prompt_scores.get(req.request_id)
            if scores is not None and scores.first == len(req.prompt_scores) + 1:  # contiguous (a recompute skips)
                req.prompt_scores.extend(zip(scores.logprobs, scores.ranks, scores.top_logprobs))
            if not s.reaches_end:
                if prefix is not None:
                    prefix.on_computed(req)
                continue
            out = outputs[req.request_id]
            if out.error is not None:
                req.error = out.error
                finished.append(self._finish_running(req, FinishReason.ERROR, error_code=500))
                continue
            rejected = s.num_draft - (len(out.accepted) - 1)
            req.num_computed_tokens -= rejected
            req.draft_token_ids = []
            req.draft_probs = None
            taken, reason = self._append(req, out.accepted)
            if taken < len(out.accepted):  # the tokens after an ending one were computed, never kept
                req.num_computed_tokens = min(req.num_computed_tokens, len(req.token_ids) - 1)
            if prefix is not None:
                prefix.on_computed(req)
            delta = TokenDelta(req.request_id, out.accepted[:taken])
            if req.params.logprobs is not None:
                delta = TokenDelta(req.request_id, delta.token_ids, out.logprobs[:taken],
                                   out.top_logprobs[:taken] if out.top_logprobs else [[] for _ in range(taken)])
            if req.params.prompt_logprobs is not None and not req.prompt_scores_sent:
                delta = TokenDelta(req.request_id, delta.token_ids, delta.logprobs, delta.top_logprobs,
                                   _prompt_logprobs(req))
            deltas.append(delta)
            if reason is not None:
                finished.append(self._finish_running(req, reason, error_code=500 if req.error else 0))
            else:
                req.draft_token_ids = list(out.drafts)
                req.draft_probs = out.draft_probs
        return deltas, finished

    def _append(self, req: Request, accepted: list[int]) -> tuple[int, FinishReason | None]:
        """Append accepted tokens up to the first that ends the request: (tokens taken, reason).
        A grammar that reaches its end ends the request (stop), ignore_eos or not."""
        p = req.params
        grammar_end = req.grammar.advance(accepted) if req.grammar is not None else None
        if grammar_end is not None and not req.grammar.terminated:  # masked sampling cannot produce it
            req.error = "the output broke its grammar (an engine bug: its tokens are masked)"
            logger.error("request %s: %s", req.request_id, req.error)
            return 0, FinishReason.ERROR
        for j, token in enumerate(accepted):
            req.token_ids.append(token)
            if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids or j == grammar_end:
                return j + 1, FinishReason.STOP
            if req.num_output_tokens >= p.max_tokens:
                return j + 1, FinishReason.LENGTH
        return len(accepted), None

    def _finish_running(self, req: Request, reason: FinishReason, error_code: int = 0) -> Finished:
        self.running.remove(req)
        return self._finish(req, reason, error_code)

    def _finish(self, req: Request, reason: FinishReason, error_code: int = 0) -> Finished:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.draft_token_ids = []
        req.draft_probs = None
        self._release(req, failed=reason is FinishReason.ERROR)
        self.requests.pop(req.request_id, None)
        return Finished(req.request_id, reason.value, req.num_prompt_tokens, req.num_output_tokens, req.error,
                        error_code, req.queued_s, cached_tokens=req.num_cached_tokens)

    def _release(self, req: Request, failed: bool = False) -> None:
        if req.seq is not None:
            if self.prefix is not None:
                self.prefix.release(req, failed)
            self.cache.free(req.seq)


def _can_run_ahead(req: Request, prev: ScheduledRequest, speculation: bool) -> bool:
    """Whether `req` may be scheduled while its step `prev` is in flight. Not when that step may
    sample its last token (max_tokens: with d drafts it samples up to d + 1), nor while prompt
    scores are still to send (they need the host). Penalties need nothing from the host: their
    counts are kept on the device (engine/output_counts.py); grammars do (their bitmask follows
    the tokens on the host). Without speculation
    (`speculation` False) a request that carries drafts is not run ahead either."""
    p = req.params
    if p.prompt_logprobs is not None and not req.prompt_scores_sent:
        return False
    if req.grammar is not None:  # its next bitmask needs the step in flight's tokens on the host
        return False
    if not speculation and (prev.num_draft or req.draft_token_ids):
        return False
    return not prev.reaches_end or req.num_output_tokens + 1 + prev.num_draft < p.max_tokens


def _prompt_logprobs(req: Request) -> PromptLogprobs:
    """The request's prompt scores for its first delta (they are sent once)."""
    req.prompt_scores_sent = True
    lps, ranks, tops = zip(*req.prompt_scores) if req.prompt_scores else ((), (), ())
    return PromptLogprobs(list(lps), list(ranks), [list(t) for t in tops])
