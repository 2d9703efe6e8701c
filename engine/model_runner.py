"""One engine step on the model: Batch → target forward → sample / verify → MTP drafts → StepOutput.

Rows that need logits are the last (1 + drafts) positions of every request whose step reaches
the end of its known tokens. With speculation on, the MTP head then consumes the target's
accepted rows (keeping its own window in step with the model's) and drafts tokens for the next
step by applying the single MTP layer to its own output. The runner reads requests and never
writes them: everything a step produced is in the returned `StepOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_backend import SequenceBackend, StepSeq
from .batch import Batch, PromptScores, RequestStepOutput, ScheduledRequest, StepOutput
from .cuda_graphs import StaticDecodeBackend
from .kv_cache import KVCache
from .model import DeepseekV4
from .sampler import apply_penalties, logprobs_of, ranks_of, sample, to_probs
from .speculative import verify


@dataclass(slots=True)
class _Pending:
    """A request that samples this step, with its rows in the logits tensor."""

    sched: ScheduledRequest
    logit_rows: slice


class ModelRunner:
    def __init__(self, model: DeepseekV4, cache: KVCache, num_speculative_tokens: int = 0,
                 static: StaticDecodeBackend | None = None):
        if num_speculative_tokens and not len(model.mtp):
            raise ValueError("--speculative-tokens needs a checkpoint with MTP weights (num_nextn_predict_layers ≥ 1)")
        self.model, self.cache, self.k = model, cache, num_speculative_tokens
        self.device = model.device
        self.static = static  # the static-shape (CUDA graph) backend; None = always per-sequence
        self.backends = ([static] if static is not None else []) + [SequenceBackend(self.device)]
        # Test hook replacing MTP drafts (e.g. to force wrong ones): f(request, accepted_now, drafts) -> drafts.
        self.draft_override = None

    def _prepare(self, rows: list[StepSeq], kind: str = "model", allow_static: bool = True):
        """The first backend that takes the step (the per-sequence one always does, zero rows too)."""
        for backend in self.backends:
            if backend is self.static and (not allow_static or not rows):
                continue
            step = backend.prepare(rows, kind)
            if step is not None:
                return step
        raise AssertionError("the sequence backend accepts every step")

    def static_ok(self, batch: Batch) -> bool:
        """Whether the static backend would take this batch's target forward (lockstep asks every
        rank before any takes it)."""
        q = batch.uniform_decode
        return (self.static is not None and q is not None
                and self.static.shape_for(len(batch.scheduled), q, max(s.end for s in batch.scheduled)) is not None)

    @torch.inference_mode()
    def execute(self, batch: Batch, num_drafts: int | None = None, allow_static: bool = True,
                lockstep: bool = False) -> StepOutput:
        """Run the step. `num_drafts` (≤ k; default k) is how many drafts to propose for the next
        step. Under `lockstep` (expert parallelism) every rank runs the same forwards, each with
        however many rows it has, zero included: one target forward, then with speculation one
        MTP catch-up forward and num_drafts − 1 draft forwards."""
        num_drafts = self.k if num_drafts is None else num_drafts
        rows = [StepSeq(s.request.seq, s.start, s.token_ids()) for s in batch.scheduled]
        pending, logit_rows, end = [], [], 0
        for s in batch.scheduled:
            end += s.num_tokens
            if s.reaches_end:  # its last (1 + drafts) rows need logits
                n = 1 + s.num_draft
                pending.append(_Pending(s, slice(len(logit_rows), len(logit_rows) + n)))
                logit_rows.extend(range(end - n, end))
        n_sampled = len(logit_rows)
        scoring = self._prompt_rows(batch, logit_rows)  # appended after the sampled rows
        allow_static = allow_static and not scoring
        streams, logits = self._prepare(rows, allow_static=allow_static).run(self.model, logit_rows)
        outputs = self._sample(pending, logits[:n_sampled]) if pending else {}
        if self.k:
            self._run_mtp(batch, streams, outputs, num_drafts, lockstep)
        return StepOutput(outputs, self._score_prompts(scoring, logits[n_sampled:]) if scoring else {})

    # ---- prompt scoring (SamplingParams.prompt_logprobs) ---------------------------------------
    @staticmethod
    def _prompt_rows(batch: Batch, logit_rows: list[int]) -> list[tuple[ScheduledRequest, int, int]]:
        """Append to `logit_rows` the rows whose logits score a prompt token not yet scored:
        row at position q scores prompt[q + 1]. Returns (request, first position, count) each."""
        scoring, end = [], 0
        for s in batch.scheduled:
            end += s.num_tokens
            req = s.request
            if req.params.prompt_logprobs is None or req.prompt_scores_sent:
                continue
            first = max(s.start, len(req.prompt_scores))  # position q; prompt_scores[q] scores token q + 1
            last = min(s.end, req.num_prompt_tokens - 1)  # exclusive; position P − 1 predicts the output
            if first < last:
                base = end - s.num_tokens - s.start  # batch row of position 0
                logit_rows.extend(range(base + first, base + last))
                scoring.append((s, first, last - first))
        return scoring

    def _score_prompts(self, scoring, logits: torch.Tensor) -> dict[int, PromptScores]:
        """logits [rows, V] of `_prompt_rows`' rows, in order → each request's PromptScores."""
        targets = torch.tensor([t for s, q, n in scoring for t in s.request.prompt_token_ids[q + 1: q + 1 + n]],
                               device=logits.device)
        top_n = max(s.request.params.prompt_logprobs for s, _, _ in scoring)
        chosen, top = logprobs_of(logits, targets, top_n)
        ranks = ranks_of(logits, targets)
        out, i = {}, 0
        for s, q, n in scoring:
            k = s.request.params.prompt_logprobs
            out[s.request.request_id] = PromptScores(q + 1, chosen[i: i + n], ranks[i: i + n],
                                                     [row[:k] for row in top[i: i + n]])
            i += n
        return out

    # ---- sampling and verification ----------------------------------------------------------
    def _sample(self, pending: list[_Pending], logits: torch.Tensor) -> dict[int, RequestStepOutput]:
        """Sample every row at once; requests with drafts then verify them row by row."""
        finite = torch.isfinite(logits).all(dim=-1)
        bad_rows = set() if bool(finite.all()) else set(torch.nonzero(~finite).flatten().tolist())
        plain = all(p.sched.num_draft == 0 and p.sched.request.params.greedy
                    and not p.sched.request.params.has_penalties for p in pending)
        if plain:  # the common decode case: one argmax over the batch, no per-row distributions
            probs, tokens = None, logits.argmax(dim=-1).tolist()
            if not bad_rows and all(p.sched.request.params.logprobs is None for p in pending):
                return {p.sched.request.request_id: RequestStepOutput([tokens[p.logit_rows.start]]) for p in pending}
        else:
            probs, tokens = self._distributions(pending, logits)
        outputs = {}
        lp_rows, lp_tokens, lp_reqs = [], [], []
        for pend in pending:
            req, s = pend.sched.request, pend.sched
            rows = pend.logit_rows
            if bad_rows and any(r in bad_rows for r in range(rows.start, rows.stop)):
                outputs[req.request_id] = RequestStepOutput([], error="non-finite logits")
                continue
            if s.num_draft == 0:
                accepted = [tokens[rows.start]]
            else:
                target = probs[rows] if probs is not None else to_probs(logits[rows], [req.params] * (s.num_draft + 1))
                drafts = req.draft_token_ids[: s.num_draft]
                draft_probs = req.draft_probs[: s.num_draft] if req.draft_probs is not None else None
                accepted = verify(target, drafts, draft_probs, req.generator)
            outputs[req.request_id] = RequestStepOutput(accepted)
            if req.params.logprobs is not None:
                lp_rows.extend(range(rows.start, rows.start + len(accepted)))
                lp_tokens.extend(accepted)
                lp_reqs.append((req, len(accepted)))
        if lp_rows:
            self._attach_logprobs(outputs, logits[lp_rows], lp_tokens, lp_reqs)
        return outputs

    def _distributions(self, pending: list[_Pending], logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Per-row sampling distributions (penalties, temperature, top-k/p, min-p) and one draw each."""
        row_params, history, generators = [], [], []
        for pend in pending:
            req, s = pend.sched.request, pend.sched
            for j in range(1 + s.num_draft):  # row j sees the outputs before it, drafts included
                row_params.append(req.params)
                generators.append(req.generator)
                history.append(req.output_token_ids + req.draft_token_ids[:j] if req.params.has_penalties else [])
        probs = to_probs(apply_penalties(logits, row_params, history), row_params)
        return probs, sample(probs, generators).tolist()

    def _attach_logprobs(self, outputs, logits: torch.Tensor, tokens: list[int], reqs) -> None:
        top_n = max(req.params.logprobs for req, _ in reqs)
        chosen, top = logprobs_of(logits, torch.tensor(tokens, device=self.device), top_n)
        i = 0
        for req, n in reqs:
            out = outputs[req.request_id]
            out.logprobs = chosen[i : i + n]
            out.top_logprobs = [row[: req.params.logprobs] for row in top[i : i + n]]
            i += n

    # ---- MTP drafting ------------------------------------------------------------------------
    def _run_mtp(self, batch: Batch, streams: torch.Tensor, outputs: dict[int, RequestStepOutput],
                 num_drafts: int, lockstep: bool) -> None:
        """Feed the MTP layer every accepted row of this step, then draft `num_drafts` tokens per
        request that sampled. Row at position q pairs the target's streams at q with token q + 1."""
        rows, mtp_rows, drafting = [], [], []
        begin = offset = 0  # row in the MTP batch / row in the target batch
        for s in batch.scheduled:
            offset += s.num_tokens
            s_offset = offset - s.num_tokens
            req = s.request
            out = outputs.get(req.request_id)
            if out is not None and out.error:
                continue
            accepted = out.accepted if out is not None else []
            n = s.num_tokens - (s.num_draft - max(len(accepted) - 1, 0)) if out is not None else s.num_tokens
            committed_end = s.start + n  # token at committed_end comes from `accepted`
            base = req.token_ids
            next_tokens = [base[q + 1] if q + 1 < len(base) else accepted[q + 1 - len(base)]
                           for q in range(s.start, s.start + n)]
            rows.extend(range(s_offset, s_offset + n))
            mtp_rows.append(StepSeq(req.seq, s.start, next_tokens))
            if out is not None:
                drafting.append((req, out, begin + n - 1, committed_end))
            begin += n
        if not rows and not lockstep:
            return
        last_rows = [row for _, _, row, _ in drafting] if num_drafts else []
        h, logits = self._prepare(mtp_rows, "mtp").run(self.model, last_rows, inputs=streams[rows])
        if num_drafts and (drafting or lockstep):  # else the MTP state was kept in step, nothing to propose
            self._draft(drafting, h, logits, num_drafts, lockstep)

    def _draft(self, drafting, h: torch.Tensor, logits: torch.Tensor | None, num_drafts: int, lockstep: bool) -> None:
        live, keep = [], []
        for j, (req, out, row, committed_end) in enumerate(drafting):
            # Drafting writes the MTP window up to position committed_end + drafts − 2.
            if self.cache.allocate(req.seq, committed_end, committed_end + num_drafts):
                live.append((req, out, row, committed_end))
                keep.append(j)
        if not live and not lockstep:
            return
        cur = h[[row for _, _, row, _ in live]]  # [R, n, D] MTP streams at each last accepted row
        logits = logits[keep] if logits is not None else None
        params = [req.params for req, *_ in live]
        drafts: list[list[int]] = [[] for _ in live]
        probs_per_step = []
        for step in range(num_drafts):
            tok_list = []
            if live:
                probs = to_probs(logits, params)
                tok = sample(probs, [req.generator for req, *_ in live])
                probs_per_step.append(probs)
                tok_list = tok.tolist()
                for j, t in enumerate(tok_list):
                    drafts[j].append(t)
            if step + 1 == num_drafts:
                break
            rows = [StepSeq(req.seq, ce + step, [t]) for (req, _, _, ce), t in zip(live, tok_list)]
            cur, logits = self._prepare(rows, "mtp").run(self.model, list(range(len(rows))), inputs=cur)
        if not live:
            return
        stacked = torch.stack(probs_per_step, dim=1)  # [R, k, V]
        for j, (req, out, _, _) in enumerate(live):
            proposed = drafts[j] if self.draft_override is None else self.draft_override(req, out.accepted, drafts[j])
            out.drafts = proposed[:num_drafts]
            out.draft_probs = None if (req.params.greedy or self.draft_override) else stacked[j]
