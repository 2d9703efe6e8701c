"""One engine step on the model: Batch → tensors → target forward → sample / verify → MTP drafts.

Rows that need logits are the last (1 + drafts) positions of every request whose step reaches
the end of its known tokens. With speculation on, the MTP head then consumes the target's
accepted rows (keeping its own window in step with the model's) and drafts k tokens for the
next step by applying the single MTP layer k times to its own output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import SeqSlice
from .cuda_graphs import DecodeGraphs, DecodeRow
from .kv_cache import KVCache
from .model import DeepseekV4
from .sampler import apply_penalties, logprobs_of, sample, to_probs
from .scheduler import Batch, RequestStepOutput, ScheduledRequest
from .speculative import verify


@dataclass(slots=True)
class _Pending:
    """A request that samples this step, with its rows in the flattened batch."""

    sched: ScheduledRequest
    logit_rows: slice  # its rows in the logits tensor (first: in the step's flattened batch)


class ModelRunner:
    def __init__(self, model: DeepseekV4, cache: KVCache, num_speculative_tokens: int = 0,
                 graphs: DecodeGraphs | None = None):
        if num_speculative_tokens and not len(model.mtp):
            raise ValueError("--speculative-tokens needs a checkpoint with MTP weights (num_nextn_predict_layers ≥ 1)")
        self.model, self.cache, self.k = model, cache, num_speculative_tokens
        self.graphs = graphs  # the static-shape decode/verify path; None = always per-sequence
        self.num_drafts = num_speculative_tokens  # drafts to propose this step (≤ k; set by the engine)
        self.device = model.device
        # Test hook replacing MTP drafts (e.g. to force wrong ones): f(request, accepted_now, drafts) -> drafts.
        self.draft_override = None

    @torch.inference_mode()
    def execute(self, batch: Batch) -> dict[str, RequestStepOutput]:
        step_tokens = [self._step_tokens(s) for s in batch.scheduled]
        streams, logits = self._decode_static(batch, step_tokens)
        pending, end = [], 0
        for s in batch.scheduled:
            end += s.num_tokens
            if s.reaches_end:  # its last (1 + drafts) rows need logits
                pending.append(_Pending(s, slice(end - 1 - s.num_draft, end)))
        if streams is None:  # the per-sequence path: any mix of prefill chunks and decodes
            streams = self._forward_sequences(batch, step_tokens)
            rows = [r for p in pending for r in range(p.logit_rows.start, p.logit_rows.stop)]
            logits = self.model.logits(streams[rows]) if pending else None
            offset = 0
            for p in pending:  # rows of `logits` are the pending rows, packed
                n = p.logit_rows.stop - p.logit_rows.start
                p.logit_rows, offset = slice(offset, offset + n), offset + n
        outputs: dict[str, RequestStepOutput] = {}
        if pending:
            outputs = self._sample(pending, logits)
        if self.k:
            self._run_mtp(batch, streams, outputs)
        return outputs

    @staticmethod
    def _step_tokens(s: ScheduledRequest) -> list[int]:
        """Token ids at positions [start, start + num_tokens): known tokens, then trailing drafts."""
        req = s.request
        end = s.start + s.num_tokens
        tokens = req.token_ids[s.start : end]
        known = len(req.token_ids)
        if end > known:  # verification
            tokens = tokens + req.draft_token_ids[max(0, s.start - known) : end - known]
        return tokens

    def _forward_sequences(self, batch: Batch, step_tokens: list[list[int]]) -> torch.Tensor:
        tokens, positions, seqs, begin = [], [], [], 0
        for s, ids in zip(batch.scheduled, step_tokens):
            n = s.num_tokens
            tokens += ids
            if n == 1:
                positions.append(s.start)
            else:
                positions += range(s.start, s.start + n)
            seqs.append(SeqSlice(s.request.seq, s.start, begin, n))
            begin += n
        return self.model(torch.tensor(tokens, device=self.device), torch.tensor(positions, device=self.device), seqs)

    def _decode_static(self, batch: Batch, step_tokens: list[list[int]]):
        """(streams, logits) from the static-shape decode path (a CUDA graph replay on GPU), or
        (None, None) when the step is not a uniform decode/verify step that a shape holds."""
        if self.graphs is None:
            return None, None
        q = batch.scheduled[0].num_tokens
        if any(not s.reaches_end or s.num_tokens != q or s.num_draft != q - 1 for s in batch.scheduled):
            return None, None
        key = self.graphs.shape_for(len(batch.scheduled), q, max(s.start for s in batch.scheduled) + q)
        if key is None:
            return None, None
        rows = []
        for s, ids in zip(batch.scheduled, step_tokens):
            seq = s.request.seq
            if s.start != seq.num_tokens:
                seq.rewind(s.start)  # rejected drafts of the previous step
            rows.append(DecodeRow(seq, s.start, ids))
        streams, logits = self.graphs.run(key, rows)
        for s in batch.scheduled:
            s.request.seq.num_tokens = s.start + q
        return streams, logits

    # ---- sampling and verification ----------------------------------------------------------
    def _sample(self, pending: list[_Pending], logits: torch.Tensor) -> dict[str, RequestStepOutput]:
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
    def _run_mtp(self, batch: Batch, streams: torch.Tensor, outputs: dict[str, RequestStepOutput]) -> None:
        """Feed the MTP layer every accepted row of this step, then draft `num_drafts` tokens per
        request that sampled. Row at position q pairs the target's streams at q with token q + 1."""
        mtp = self.model.mtp[0]
        rows, next_tokens, positions, seqs, drafting = [], [], [], [], []
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
            if req.mtp_seq is None:
                req.mtp_seq = self.cache.new_mtp_sequence(req.seq)
            base = s.request.token_ids
            for q in range(s.start, s.start + n):
                nxt = q + 1
                next_tokens.append(base[nxt] if nxt < len(base) else accepted[nxt - len(base)])
            rows.extend(range(s_offset, s_offset + n))
            positions.extend(range(s.start, s.start + n))
            seqs.append(SeqSlice(req.mtp_seq, s.start, begin, n))
            if out is not None:
                drafting.append((req, out, begin + n - 1, committed_end))
            begin += n
        if not rows:
            return
        h = mtp(self.model, streams[rows], torch.tensor(next_tokens, device=self.device),
                torch.tensor(positions, device=self.device), seqs)
        self._draft(drafting, h)

    def _draft(self, drafting, h: torch.Tensor) -> None:
        mtp = self.model.mtp[0]
        if self.num_drafts == 0:  # speculation turned down: the MTP state was kept in step, nothing to propose
            return
        live = []
        for req, out, row, committed_end in drafting:
            # Drafting writes the MTP window up to position committed_end + drafts − 2.
            if self.cache.allocate(req.seq, committed_end, committed_end + self.num_drafts):
                live.append((req, out, row, committed_end))
        if not live:
            return
        cur = h[[row for _, _, row, _ in live]]  # [R, n, D] MTP streams at each last accepted row
        params = [req.params for req, *_ in live]
        drafts = [[] for _ in live]
        probs_per_step = []
        logits = mtp.logits(self.model, cur)
        key = self.graphs.mtp_shape_for(len(live)) if self.graphs is not None else None
        for step in range(self.num_drafts):
            probs = to_probs(logits, params)
            tok = sample(probs, [req.generator for req, *_ in live])
            probs_per_step.append(probs)
            tok_list = tok.tolist()
            for j, t in enumerate(tok_list):
                drafts[j].append(t)
            if step + 1 == self.num_drafts:
                break
            if key is not None:  # the draft step from a CUDA graph (static shape)
                cur, logits = self._draft_step_static(key, live, step, tok_list, cur)
                continue
            pos = torch.tensor([ce + step for *_, ce in live], device=self.device)
            seqs = [SeqSlice(req.mtp_seq, ce + step, j, 1) for j, (req, _, _, ce) in enumerate(live)]
            cur = mtp(self.model, cur, tok, pos, seqs)
            logits = mtp.logits(self.model, cur)
        stacked = torch.stack(probs_per_step, dim=1)  # [R, k, V]
        for j, (req, out, _, _) in enumerate(live):
            proposed = drafts[j] if self.draft_override is None else self.draft_override(req, out.accepted, drafts[j])
            out.drafts = proposed[: self.num_drafts]
            req.draft_probs = None if (req.params.greedy or self.draft_override) else stacked[j]

    def _draft_step_static(self, key, live, step: int, tokens: list[int], cur: torch.Tensor):
        """One MTP application to every live request's previous draft at position
        committed_end + step, on the static path; keeps the MTP states' counters."""
        rows = []
        for (req, _, _, committed_end), token in zip(live, tokens):
            pos = committed_end + step
            if req.mtp_seq.num_tokens != pos:
                req.mtp_seq.rewind(pos)
            rows.append(DecodeRow(req.seq, pos, [token]))  # the MTP state shares the main block table
        streams, logits = self.graphs.run(key, rows, cur)
        for req, _, _, committed_end in live:
            req.mtp_seq.num_tokens = committed_end + step + 1
        return streams, logits
