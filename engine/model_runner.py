"""One engine step on the model: Batch → target forward → sample / verify → MTP drafts → StepOutput.

Rows that need logits are the last (1 + drafts) positions of every request whose step reaches
the end of its known tokens. They are sampled and verified on the device in one batched pass
(engine/step_sampling.py). With speculation on, the MTP head then consumes the step's rows
(keeping its own window in step with the model's) and drafts tokens for the next step by
applying the single MTP layer to its own output — also on the device: the catch-up forward
takes every scheduled row (rows past a request's accepted tokens compute MTP window entries
that are overwritten before anything reads them), the draft forwards are static-shape steps
whose positions are advanced on the device. The step then reads everything back once (one host
sync); only when no static MTP shape holds the drafting rows does it read the acceptance counts
first. The runner reads requests and never writes them: everything a step produced is in the
returned `StepOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import counter_rng
from .attention_backend import SequenceBackend, StepSeq
from .batch import Batch, PromptScores, RequestStepOutput, ScheduledRequest, StepOutput
from .cuda_graphs import StaticDecodeBackend
from .kv_cache import KVCache
from .model import DeepseekV4
from .sampler import SamplingRows, logprobs_of, probs_device, ranks_of, sample_device
from .step_sampling import DeviceSample, HostSample, PendingRead, StepSampler, _device_ints, start_read


@dataclass(slots=True)
class _Pending:
    """A request that samples this step, with its rows in the logits tensor."""

    sched: ScheduledRequest
    logit_rows: slice


@dataclass
class _Drafts:
    """The step's drafts on the device: rows `live` of the pending list."""

    live: list[int]  # indices into pending
    tokens: torch.Tensor  # [R, num_drafts] int64
    probs: torch.Tensor | None  # [R, num_drafts, V] (None: every drafting request greedy)


@dataclass
class LaunchedStep:
    """A step whose work is issued: its results arrive on the host at `ModelRunner.finish`."""

    batch: Batch
    pending: list[_Pending]
    sample: DeviceSample | None
    drafts: _Drafts | None
    host: PendingRead | HostSample | None  # the copy in flight (or, read mid-step, its result)
    scores: dict[int, PromptScores]


class ModelRunner:
    def __init__(self, model: DeepseekV4, cache: KVCache, num_speculative_tokens: int = 0,
                 static: StaticDecodeBackend | None = None):
        if num_speculative_tokens and not len(model.mtp):
            raise ValueError("--speculative-tokens needs a checkpoint with MTP weights (num_nextn_predict_layers ≥ 1)")
        self.model, self.cache, self.k = model, cache, num_speculative_tokens
        self.device = model.device
        self.static = static  # the static-shape (CUDA graph) backend; None = always per-sequence
        self.backends = ([static] if static is not None else []) + [SequenceBackend(self.device)]
        self.sampler = StepSampler(self.device)
        # Test hook replacing MTP drafts (e.g. to force wrong ones): f(request, accepted_now, drafts) -> drafts.
        self.draft_override = None
        self.num_host_reads = 0  # device → host reads (syncs) issued by steps so far

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

    def execute(self, batch: Batch, num_drafts: int | None = None, allow_static: bool = True,
                lockstep: bool = False) -> StepOutput:
        """Run the step and read it back. `num_drafts` (≤ k; default k) is how many drafts to
        propose for the next step. Under `lockstep` (expert parallelism) every rank runs the same
        forwards, each with however many rows it has, zero included: one target forward, then
        with speculation one MTP catch-up forward and num_drafts − 1 draft forwards."""
        return self.finish(self.launch(batch, num_drafts, allow_static, lockstep))

    @torch.inference_mode()
    def launch(self, batch: Batch, num_drafts: int | None = None, allow_static: bool = True,
               lockstep: bool = False, ahead: "LaunchedStep | None" = None) -> "LaunchedStep":
        """Issue the step's work and the copy of its results to the host, without waiting for
        them (`finish` waits). `ahead`: the launched step whose sampled tokens fill this batch's
        placeholders (async scheduling; it ran without drafts, so each sampling request's new
        token is column 0 of its emitted row)."""
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
        step = self._prepare(rows, allow_static=allow_static)
        if ahead is not None and any(s.num_placeholder for s in batch.scheduled):
            step.set_token_ids(self._placeholder_tokens(batch, rows, ahead))
        streams, logits = step.run(self.model, logit_rows)
        sample = self._sample(pending, logits[:n_sampled]) if pending else None
        drafts = early = None
        if self.k:
            drafts, early = self._run_mtp(batch, streams, pending, sample, num_drafts, lockstep)
        draft_tokens = drafts.tokens if drafts is not None else None
        if early is None:
            host = self._start_read(sample, draft_tokens)
        else:  # the acceptance counts were read mid-step (no static MTP shape): now the drafts
            host = early
            if draft_tokens is not None:
                host.drafts = self._read(None, draft_tokens).drafts
        # prompt scores read their logits now: static outputs are overwritten by the next launch
        scores = self._score_prompts(scoring, logits[n_sampled:]) if scoring else {}
        return LaunchedStep(batch, pending, sample, drafts, host, scores)

    def finish(self, launched: "LaunchedStep") -> StepOutput:
        """Wait for a launched step's results (its one host sync) and turn them into outputs."""
        host = launched.host.wait() if isinstance(launched.host, PendingRead) else launched.host
        return StepOutput(self._outputs(launched.pending, host, launched.drafts), launched.scores)

    def _placeholder_tokens(self, batch: Batch, rows: list[StepSeq], ahead: "LaunchedStep") -> torch.Tensor:
        """The step's token ids [T] on the device: the rows' known tokens, and at each placeholder
        the token `ahead` sampled for that request."""
        assert ahead.sample is not None and ahead.sample.emitted.shape[1] == 1, "async steps carry no drafts"
        sampled_at = {p.sched.request.request_id: i for i, p in enumerate(ahead.pending)}
        known = [t for r in rows for t in r.token_ids]
        source = []
        for s in batch.scheduled:
            source += [-1] * (s.num_tokens - s.num_placeholder)
            if s.num_placeholder:
                source.append(sampled_at[s.request.request_id])
        return self._next_tokens(known, source, ahead.sample)

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

    # ---- sampling and the read back ---------------------------------------------------------------
    def _sample(self, pending: list[_Pending], logits: torch.Tensor) -> DeviceSample:
        return self.sampler.sample(pending, logits)

    def _read(self, sample: DeviceSample | None, drafts: torch.Tensor | None) -> HostSample | None:
        pending = self._start_read(sample, drafts)
        return pending.wait() if pending is not None else None

    def _start_read(self, sample: DeviceSample | None, drafts: torch.Tensor | None) -> PendingRead | None:
        if sample is None and drafts is None:
            return None
        self.num_host_reads += 1
        return start_read(sample, drafts)

    def _outputs(self, pending: list[_Pending], host: HostSample | None,
                 drafts: _Drafts | None) -> dict[int, RequestStepOutput]:
        outputs = {}
        draft_row = {i: r for r, i in enumerate(drafts.live)} if drafts is not None else {}
        for i, pend in enumerate(pending):
            req = pend.sched.request
            if not host.finite[i]:
                outputs[req.request_id] = RequestStepOutput([], error="non-finite logits")
                continue
            n = int(host.num_accepted[i]) + 1
            out = RequestStepOutput([int(t) for t in host.emitted[i, :n]])
            top = req.params.logprobs
            if top is not None:
                out.logprobs = [float(v) for v in host.chosen[i, :n]]
                out.top_logprobs = [list(zip(host.top_ids[i, j, :top].tolist(), host.top_values[i, j, :top].tolist()))
                                    if top else [] for j in range(n)]
            r = draft_row.get(i)
            if r is not None:
                proposed = [int(t) for t in host.drafts[r]]
                if self.draft_override is not None:
                    proposed = self.draft_override(req, out.accepted, proposed)
                out.drafts = proposed[: host.drafts.shape[1]]
                keep = drafts.probs is not None and not (req.params.greedy or self.draft_override)
                out.draft_probs = drafts.probs[r] if keep else None
            outputs[req.request_id] = out
        return outputs

    # ---- MTP drafting ------------------------------------------------------------------------------
    def _run_mtp(self, batch: Batch, streams: torch.Tensor, pending: list[_Pending], sample: DeviceSample | None,
                 num_drafts: int, lockstep: bool) -> tuple[_Drafts | None, HostSample | None]:
        """Feed the MTP layer every row of this step (row at position p pairs the target's streams
        at p with token p + 1: known, or emitted this step), then draft `num_drafts` tokens per
        request that sampled, from the row of its last accepted token."""
        if not batch.scheduled and not lockstep:
            return None, None
        q_len = sample.emitted.shape[1] if sample is not None else 1
        pend_index = {p.sched.request.request_id: i for i, p in enumerate(pending)}
        mtp_rows, known, source, cand = [], [], [], []
        offset = 0
        for s in batch.scheduled:
            base, i = s.request.token_ids, pend_index.get(s.request.request_id)
            for p in range(s.start, s.end):
                emitted_at = p + 1 - len(base)  # ≥ 0: the token comes from this step's emitted row
                known.append(base[p + 1] if emitted_at < 0 else 0)
                source.append(i * q_len + emitted_at if emitted_at >= 0 else -1)
            mtp_rows.append(StepSeq(s.request.seq, s.start, [0] * s.num_tokens))
            if i is not None:  # its candidate last-accepted rows: the request's 1 + d logits rows
                first = offset + s.num_tokens - 1 - s.num_draft
                cand.append([first + min(j, s.num_draft) for j in range(q_len)])
            offset += s.num_tokens
        tokens = self._next_tokens(known, source, sample)
        step = self._prepare(mtp_rows, "mtp")
        step.set_token_ids(tokens)
        flat = [r for c in cand for r in c]
        h, logits = step.run(self.model, flat, inputs=streams[:offset])
        if not num_drafts or not (pending or lockstep):
            return None, None  # the MTP state was kept in step, nothing to propose
        return self._draft(pending, h, logits, cand, sample, num_drafts, lockstep)

    def _next_tokens(self, known: list[int], source: list[int], sample: DeviceSample | None) -> torch.Tensor:
        grid = _device_ints([known, source], self.device)
        if sample is None or not any(s >= 0 for s in source):
            return grid[0]
        picked = sample.emitted.flatten()[grid[1].clamp(min=0)].clamp(min=0)  # −1 (past the accepted) → 0
        return torch.where(grid[1] >= 0, picked, grid[0])

    def _draft(self, pending: list[_Pending], h: torch.Tensor, logits: torch.Tensor | None, cand: list[list[int]],
               sample: DeviceSample, num_drafts: int, lockstep: bool) -> tuple[_Drafts | None, HostSample | None]:
        live = []
        for i, p in enumerate(pending):
            s = p.sched
            # Drafting writes the MTP window up to position (committed end) + drafts − 2 < s.end + drafts.
            if self.cache.allocate(s.request.seq, s.end, s.end + num_drafts):
                live.append(i)
        if not live and not lockstep:
            return None, None
        q_len = len(cand[0]) if cand else 1
        n_acc = sample.num_accepted[live] if live else None  # [R]
        at = _device_ints([[cand[i][j] for j in range(q_len)] for i in live], self.device) if live else None
        rows_h = at.gather(1, n_acc[:, None]).squeeze(1) if live else None  # row of each last accepted token
        cur = h[rows_h] if live else h[:0]
        logits = logits.view(len(pending), q_len, -1)[live].gather(
            1, n_acc[:, None, None].expand(-1, 1, logits.shape[-1])).squeeze(1) if live else None
        reqs = [pending[i].sched for i in live]
        # The token after the last accepted one sits at `committed` = s.end − d + n_acc; draft j at committed + j.
        committed = _device_ints([[s.end - s.num_draft for s in reqs]], self.device)[0] + n_acc if live else None
        seeds = _device_ints([[self.sampler.seed_of(s.request) for s in reqs]], self.device)[0] if live else None
        params = [s.request.params for s in reqs]
        greedy = all(p.greedy for p in params)
        rows_params = SamplingRows(params, [0] * len(params), [0] * len(params), self.device) if live else None
        toks, probs_per_step, host = [], [], None
        for j in range(1, num_drafts + 1):
            if live:
                probs = probs_device(logits, rows_params)
                keys = None if greedy else counter_rng.row_keys(seeds, committed + j, counter_rng.DRAFT)
                toks.append(sample_device(probs, keys))
                probs_per_step.append(probs)
            if j == num_drafts:
                break
            step, host = self._draft_step(reqs, committed, j, toks, sample, host, live)
            cur, logits = step.run(self.model, list(range(len(live))), inputs=cur)  # every row
        if not live:
            return None, host
        stacked = None if greedy else torch.stack(probs_per_step, dim=1)  # [R, k, V]
        return _Drafts(live, torch.stack(toks, dim=1), stacked), host

    def _draft_step(self, reqs: list[ScheduledRequest], committed, j: int, toks: list, sample: DeviceSample,
                    host: HostSample | None, live: list[int]):
        """The MTP forward producing draft j + 1: row at position committed + j − 1 with draft j.
        A static 'mtp' shape takes the positions on the device; otherwise they are read first."""
        rows = [StepSeq(s.request.seq, s.start + 1, [0]) for s in reqs]  # start: the smallest possible
        step = self.static.prepare(rows, "mtp") if self.static is not None and rows else None
        if step is not None:
            step.advance(committed + (j - 1), toks[-1])
            return step, host
        if host is None and reqs:  # no static shape for these rows: read the acceptance counts now
            host = self._read(sample, None)
        starts = [s.end - s.num_draft + int(host.num_accepted[i]) + j - 1 for s, i in zip(reqs, live)] if reqs else []
        step = self._prepare([StepSeq(s.request.seq, p, [0]) for s, p in zip(reqs, starts)], "mtp")
        if reqs:
            step.set_token_ids(toks[-1])
        return step, host
