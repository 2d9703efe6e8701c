"""One engine step on the model: Batch → target forward → sample / verify → MTP drafts → StepOutput.

Rows that need logits are the last (1 + drafts) positions of every request whose step reaches
the end of its known tokens. They are sampled and verified on the device in one batched pass
(engine/step_sampling.py). With speculation on, the MTP head then consumes the step's rows
(keeping its own window in step with the model's) and drafts tokens for the next step by
applying the single MTP layer to its own output — also on the device: the catch-up forward
takes every scheduled row (rows past a request's accepted tokens compute MTP window entries
that are overwritten before anything reads them), then the draft forwards and the draft
sampling between them run as one static program (engine/draft_chain.py: one CUDA graph), or,
without one (penalties, lockstep, no static shape), as static-shape steps whose positions are
advanced on the device. The step then reads everything back once (one host sync); only when no
static MTP shape holds the drafting rows does it read the acceptance counts first. The runner
reads requests and never writes them: everything a step produced is in the returned
`StepOutput`.

Async scheduling (`launch(..., ahead=step_in_flight)`): a step may be launched before its
predecessor is read back. Its placeholders (the predecessor's new token and drafts) are filled
from the predecessor's device results, and after a verification its rows' positions are moved
on the device by the predecessor's acceptance counts (static shapes only: `runs_ahead`), so
the sampling noise, the MTP catch-up and the drafts all see the true positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import counter_rng
from .attention_backend import SequenceBackend, StepSeq
from .batch import Batch, PromptScores, RequestStepOutput, ScheduledRequest, StepOutput
from .cuda_graphs import StaticDecodeBackend, StaticStep
from .draft_chain import chain_kind
from .kv_cache import KVCache
from .sampler import SamplingRows, logprobs_of, probs_device, ranks_of, sample_device
from .step_sampling import AheadDrafts, DeviceSample, HostSample, PendingRead, StepSampler, _device_ints, start_read


@dataclass(slots=True)
class _Pending:
    """A request that samples this step, with its rows in the logits tensor."""

    sched: ScheduledRequest
    logit_rows: slice


@dataclass
class Drafts:
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
    drafts: Drafts | None
    host: PendingRead | HostSample | None  # the copy in flight (or, read mid-step, its result)
    scores: dict[int, PromptScores]


@dataclass
class _AheadInputs:
    """A step's inputs that come from the step in flight, on the device (async scheduling)."""

    tokens: torch.Tensor  # [T] the step's token ids, placeholders filled
    shifts: torch.Tensor | None  # [n scheduled] position shifts (None: no row is shifted)
    pending_shifts: torch.Tensor | None  # [P] the same for the sampling requests
    drafts: AheadDrafts | None  # drafts proposed by the step in flight that this step verifies


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, num_speculative_tokens: int = 0,
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
        """The first backend that takes the step (the per-sequence one always does, zero rows too).
        Zero rows on the static backend (a lockstep rank with nothing to run while the others
        replay static shapes): its padding-only shape, so the collectives inside are the graph's."""
        for backend in self.backends:
            if backend is self.static and not allow_static:
                continue
            step = backend.prepare(rows, kind) if rows or backend is not self.static else backend.padding_step(kind)
            if step is not None:
                return step
        raise AssertionError("the sequence backend accepts every step")

    def static_ok(self, batch: Batch) -> bool:
        """Whether the static backend would take this batch's target forward (lockstep asks every
        rank before any takes it). An empty batch (an idle rank's dummy step) can always take its
        padding-only shape: one idle rank must not send the whole group to eager steps."""
        if not batch.scheduled:
            return self.static is not None
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
        them (`finish` waits). `ahead`: the launched step whose results fill this batch's
        placeholders — its new tokens and drafts — and shift its rows' positions (async
        scheduling; see `_ahead_inputs`)."""
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
        step = None
        if allow_static and ahead is None and not lockstep and not self.k:
            step, greedy = self._greedy_steps(batch, rows, pending)
            if greedy is not None:
                return greedy
        flow = self._ahead_inputs(batch, rows, pending, ahead) if ahead is not None else None
        if flow is not None and flow.shifts is not None:
            step = self._shifted(rows, "model", flow.shifts, max(s.max_end for s in batch.scheduled))
        elif step is None:
            step = self._prepare(rows, allow_static=allow_static)
        if flow is not None:
            step.set_token_ids(flow.tokens)
        streams, logits = step.run(self.model, logit_rows)
        sample = self._sample(pending, logits[:n_sampled], flow) if pending else None
        drafts = early = None
        if self.k:
            drafts, early = self._run_mtp(batch, streams, pending, sample, num_drafts, lockstep, flow)
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

    def _greedy_steps(self, batch: Batch, rows: list[StepSeq], pending: list[_Pending]
                      ) -> tuple[StaticStep | None, "LaunchedStep | None"]:
        """Several greedy decode steps in one call, where the scheduler gave every request a
        lookahead (ScheduledRequest.lookahead: plain greedy decodes with KV blocks past this step)
        and a compiled CPU step covers the shape (kernels/cpu_step.greedy_steps): up to 1 + the
        smallest lookahead tokens per request, as accepted tokens, the call stopping after a step
        in which a request met one of its stop ids. (prepared static step or None, the launched
        step or None: run the usual single step, on that prepared step when there is one)."""
        if self.static is None or not batch.scheduled or batch.uniform_decode != 1:
            return None, None
        steps = 1 + min(s.lookahead for s in batch.scheduled)
        if steps == 1:
            return None, None
        step = self.static.prepare(rows, reach=max(r.start for r in rows) + steps)
        if step is None:
            return None, None
        stops = self._stop_ids(pending)
        ran = step.run_greedy(steps, stops)
        if ran is None:
            return step, None
        tokens, finite = ran
        accepted = np.full(len(pending), tokens.shape[1] - 1, np.int64)
        host = HostSample(tokens, accepted, finite, None, None, None, None)
        sample = DeviceSample(torch.from_numpy(tokens), torch.from_numpy(accepted), torch.from_numpy(finite), None,
                              host)
        return step, LaunchedStep(batch, pending, sample, None, host, {})

    def _stop_ids(self, pending: list[_Pending]) -> np.ndarray:
        """[P, S] int64: each request's ids that end it (EOS unless ignore_eos, its stop_token_ids),
        −1 padding: where a multi-step call stops. The scheduler's update applies the stop rules."""
        eos = tuple(self.model.cfg.eos_token_ids)
        ids = [tuple(p.sched.request.params.stop_token_ids) + (() if p.sched.request.params.ignore_eos else eos)
               for p in pending]
        out = np.full((len(ids), max(map(len, ids), default=0)), -1, np.int64)
        for i, row in enumerate(ids):
            out[i, : len(row)] = row
        return out

    def finish(self, launched: "LaunchedStep") -> StepOutput:
        """Wait for a launched step's results (its one host sync) and turn them into outputs."""
        host = launched.host.wait() if isinstance(launched.host, PendingRead) else launched.host
        return StepOutput(self._outputs(launched.pending, host, launched.drafts), launched.scores)

    def runs_ahead(self, batch: Batch) -> bool:
        """Whether a batch scheduled ahead of the step in flight can be launched before that
        step's results reach the host. A shifted batch (ScheduledRequest.shift) needs the
        static shapes, whose positions can move on the device: its target forward, MTP
        catch-up and draft steps."""
        if not any(s.shift for s in batch.scheduled):
            return True
        q, n, static = batch.uniform_decode, len(batch.scheduled), self.static
        if static is None or q is None:
            return False
        if static.shape_for(n, q, max(s.max_end for s in batch.scheduled)) is None:
            return False
        return not self.k or (static.mtp_shape_for(n, q) is not None and static.mtp_shape_for(n, 1) is not None)

    def _shifted(self, rows: list[StepSeq], kind: str, shifts: torch.Tensor, reach: int):
        """A static step over `rows` whose positions move by `shifts` [len(rows)] on the device."""
        step = self.static.prepare(rows, kind, reach=reach) if self.static is not None else None
        assert step is not None, "a shifted step runs a static shape (ModelRunner.runs_ahead)"
        step.shift(shifts)
        return step

    def _ahead_inputs(self, batch: Batch, rows: list[StepSeq], pending: list[_Pending],
                      ahead: "LaunchedStep") -> "_AheadInputs | None":
        """What this step takes from the step in flight `ahead` on the device (async scheduling):
        at each placeholder the token it samples for the request (the one after its accepted
        drafts), then the drafts it proposes; each shifted row's shift (its acceptance count).
        None when no row has a placeholder."""
        if not any(s.num_placeholder for s in batch.scheduled):
            return None
        assert self.draft_override is None, "draft_override edits drafts on the host: not under async scheduling"
        sample, drafts = ahead.sample, ahead.drafts
        sampled_at = {p.sched.request.request_id: i for i, p in enumerate(ahead.pending)}
        draft_row = {ahead.pending[i].sched.request.request_id: r for r, i in enumerate(drafts.live)} if drafts else {}
        k = drafts.tokens.shape[1] if drafts is not None else 0
        num_new = sample.num_accepted.shape[0]
        # source: −1 = the row's known token; else an index into [new tokens (P), drafts (R·k)]
        source, shift_from, ahead_rows = [], [], {}
        for s in batch.scheduled:
            rid = s.request.request_id
            source += [-1] * (s.num_tokens - s.num_placeholder)
            if s.num_placeholder:
                source.append(sampled_at[rid])
                source += [num_new + draft_row[rid] * k + j for j in range(s.num_placeholder - 1)]
            shift_from.append(sampled_at[rid] if s.shift else -1)
        for i, p in enumerate(pending):
            if p.sched.num_placeholder > 1:  # it verifies drafts the step in flight proposed
                ahead_rows[i] = draft_row[p.sched.request.request_id]
        known = [t for r in rows for t in r.token_ids]
        grid = _device_ints([known, source], self.device)
        new = sample.emitted.gather(1, sample.num_accepted[:, None]).squeeze(1).clamp(min=0)  # [P]
        pool = torch.cat((new, drafts.tokens.flatten())) if drafts is not None else new
        tokens = torch.where(grid[1] >= 0, pool[grid[1].clamp(min=0)], grid[0])
        shifts = pending_shifts = None
        if any(f >= 0 for f in shift_from):
            index = _device_ints([shift_from], self.device)[0]
            shifts = torch.where(index >= 0, sample.num_accepted[index.clamp(min=0)], 0)  # [n]
            order = {s.request.request_id: i for i, s in enumerate(batch.scheduled)}
            pending_shifts = shifts[_device_ints([[order[p.sched.request.request_id] for p in pending]],
                                                 self.device)[0]] if pending else None
        verified = None
        if ahead_rows:
            live = list(ahead_rows.values())
            at = _device_ints([live, list(ahead_rows)], self.device)
            verified = AheadDrafts({i: j for j, i in enumerate(ahead_rows)}, at[1], drafts.tokens[at[0]],
                                   drafts.probs[at[0]] if drafts.probs is not None else None)
        return _AheadInputs(tokens, shifts, pending_shifts, verified)

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
    def _sample(self, pending: list[_Pending], logits: torch.Tensor,
                flow: "_AheadInputs | None" = None) -> DeviceSample:
        if flow is None:
            return self.sampler.sample(pending, logits)
        return self.sampler.sample(pending, logits, flow.pending_shifts, flow.drafts)

    def _read(self, sample: DeviceSample | None, drafts: torch.Tensor | None) -> HostSample | None:
        pending = self._start_read(sample, drafts)
        return pending.wait() if pending is not None else None

    def _start_read(self, sample: DeviceSample | None, drafts: torch.Tensor | None) -> PendingRead | None:
        if sample is None and drafts is None:
            return None
        self.num_host_reads += 1
        return start_read(sample, drafts)

    def _outputs(self, pending: list[_Pending], host: HostSample | None,
                 drafts: Drafts | None) -> dict[int, RequestStepOutput]:
        outputs = {}
        if not pending:
            return outputs
        draft_row = {i: r for r, i in enumerate(drafts.live)} if drafts is not None else {}
        # Python lists first: one conversion each instead of a numpy scalar per element
        finite, accepted, emitted = host.finite.tolist(), host.num_accepted.tolist(), host.emitted.tolist()
        for i, pend in enumerate(pending):
            req = pend.sched.request
            if not finite[i]:
                outputs[req.request_id] = RequestStepOutput([], error="non-finite logits")
                continue
            n = accepted[i] + 1
            out = RequestStepOutput(emitted[i][:n])
            top = req.params.logprobs
            if top is not None:
                out.logprobs = [float(v) for v in host.chosen[i, :n]]
                out.top_logprobs = [list(zip(host.top_ids[i, j, :top].tolist(), host.top_values[i, j, :top].tolist()))
                                    if top else [] for j in range(n)]
            r = draft_row.get(i)
            if r is not None:
                proposed = host.drafts[r].tolist()
                if self.draft_override is not None:
                    proposed = self.draft_override(req, out.accepted, proposed)
                out.drafts = proposed[: host.drafts.shape[1]]
                keep = drafts.probs is not None and not (req.params.greedy or self.draft_override)
                out.draft_probs = drafts.probs[r] if keep else None
            outputs[req.request_id] = out
        return outputs

    # ---- MTP drafting ------------------------------------------------------------------------------
    def _run_mtp(self, batch: Batch, streams: torch.Tensor, pending: list[_Pending], sample: DeviceSample | None,
                 num_drafts: int, lockstep: bool,
                 flow: _AheadInputs | None = None) -> tuple[Drafts | None, HostSample | None]:
        """Feed the MTP layer every row of this step (row at position p pairs the target's streams
        at p with token p + 1: known, or emitted this step), then draft `num_drafts` tokens per
        request that sampled, from the row of its last accepted token. `flow`: the inputs taken
        from the step in flight (async scheduling), whose shifts move these rows too."""
        if not batch.scheduled and not lockstep:
            return None, None
        q_len = sample.emitted.shape[1] if sample is not None else 1
        pend_index = {p.sched.request.request_id: i for i, p in enumerate(pending)}
        mtp_rows, known, source, cand = [], [], [], []
        offset = 0
        for s in batch.scheduled:
            base, i = s.request.token_ids, pend_index.get(s.request.request_id)
            # tokens the step knows: the host's, and the first placeholder (the in flight step's new token)
            num_known = len(base) + (1 if s.num_placeholder else 0)
            for p in range(s.start, s.end):
                emitted_at = p + 1 - num_known  # ≥ 0: the token comes from this step's emitted row
                known.append(base[p + 1] if emitted_at < 0 else 0)
                source.append(i * q_len + emitted_at if emitted_at >= 0 else -1)
            mtp_rows.append(StepSeq(s.request.seq, s.start, [0] * s.num_tokens))
            if i is not None:  # its candidate last-accepted rows: the request's 1 + d logits rows
                first = offset + s.num_tokens - 1 - s.num_draft
                cand.append([first + min(j, s.num_draft) for j in range(q_len)])
            offset += s.num_tokens
        tokens = self._next_tokens(known, source, sample)
        shifts = flow.shifts if flow is not None else None
        if shifts is not None:
            step = self._shifted(mtp_rows, "mtp", shifts, max(s.max_end for s in batch.scheduled))
        else:
            step = self._prepare(mtp_rows, "mtp")
        step.set_token_ids(tokens)
        flat = [r for c in cand for r in c]
        h, logits = step.run(self.model, flat, inputs=streams[:offset])
        if not num_drafts or not (pending or lockstep):
            return None, None  # the MTP state was kept in step, nothing to propose
        return self._draft(pending, h, logits, cand, sample, num_drafts, lockstep,
                           flow.pending_shifts if flow is not None else None)

    def _next_tokens(self, known: list[int], source: list[int], sample: DeviceSample | None) -> torch.Tensor:
        grid = _device_ints([known, source], self.device)
        if sample is None or not any(s >= 0 for s in source):
            return grid[0]
        picked = sample.emitted.flatten()[grid[1].clamp(min=0)].clamp(min=0)  # −1 (past the accepted) → 0
        return torch.where(grid[1] >= 0, picked, grid[0])

    def _draft(self, pending: list[_Pending], h: torch.Tensor, logits: torch.Tensor | None, cand: list[list[int]],
               sample: DeviceSample, num_drafts: int, lockstep: bool,
               shifts: torch.Tensor | None = None) -> tuple[Drafts | None, HostSample | None]:
        """`shifts` [P]: the sampling requests' position shifts (async scheduling), or None."""
        live = []
        for i, p in enumerate(pending):
            s = p.sched
            # Drafting writes the MTP window up to position (committed end) + drafts − 2 < s.max_end + drafts.
            if self.cache.allocate(s.request.seq, s.end, s.max_end + num_drafts):
                live.append(i)
        if not live and not lockstep:
            return None, None
        q_len = len(cand[0]) if cand else 1
        live_index = _device_ints([live], self.device)[0] if live else None  # [R]
        n_acc = sample.num_accepted[live_index] if live else None  # [R]
        at = _device_ints([[cand[i][j] for j in range(q_len)] for i in live], self.device) if live else None
        rows_h = at.gather(1, n_acc[:, None]).squeeze(1) if live else None  # row of each last accepted token
        cur = h[rows_h] if live else h[:0]
        logits = logits.view(len(pending), q_len, -1)[live_index].gather(
            1, n_acc[:, None, None].expand(-1, 1, logits.shape[-1])).squeeze(1) if live else None
        reqs = [pending[i].sched for i in live]
        # The token after the last accepted one sits at `committed` = s.end − d + n_acc; draft j at committed + j.
        committed = _device_ints([[s.end - s.num_draft for s in reqs]], self.device)[0] + n_acc if live else None
        if live and shifts is not None:
            committed = committed + shifts[live_index]
        seeds = _device_ints([[self.sampler.seed_of(s.request) for s in reqs]], self.device)[0] if live else None
        params = [s.request.params for s in reqs]
        greedy = all(p.greedy for p in params)
        penalized = any(p.has_penalties for p in params)
        rows_params = SamplingRows(params, [0] * len(params), [0] * len(params), self.device) if live else None
        # Every draft in one static program (one graph replay on CUDA); not under lockstep, where
        # each draft forward is a collective step the ranks take together (and not with penalties).
        chain = self._draft_chain(reqs, num_drafts, rows_params) if live and not (penalized or lockstep) else None
        if chain is not None:
            tokens, stacked = chain.run(cur, logits, committed, seeds, rows_params)
            return Drafts(live, tokens, None if greedy else stacked), None
        if live and penalized:  # as the target will: this step's tokens count, then each draft
            rows_params.penalty = self.sampler.penalty_rows([s.request for s in reqs], logits.shape[-1])
        toks, probs_per_step, host, step = [], [], None, None
        for j in range(1, num_drafts + 1):
            if live:
                probs = probs_device(logits, rows_params)
                keys = None if greedy else counter_rng.row_keys(seeds, committed + j, counter_rng.DRAFT)
                toks.append(sample_device(probs, keys))
                probs_per_step.append(probs)
                if rows_params.penalty is not None:
                    at, counts = rows_params.penalty
                    counts.scatter_add_(1, toks[-1][at, None], torch.ones(at.shape[0], 1, device=counts.device))
            if j == num_drafts:
                break
            step, host = self._draft_step(reqs, committed, j, toks, sample, host, live,
                                          step if isinstance(step, StaticStep) else None)
            cur, logits = step.run(self.model, list(range(len(live))), inputs=cur)  # every row
        if not live:
            return None, host
        stacked = None if greedy else torch.stack(probs_per_step, dim=1)  # [R, k, V]
        return Drafts(live, torch.stack(toks, dim=1), stacked), host

    def _draft_chain(self, reqs: list[ScheduledRequest], num_drafts: int, rows: SamplingRows):
        """The static drafting chain for these requests (engine/draft_chain.py), or None."""
        if self.static is None:
            return None
        return self.static.draft_chain(_draft_rows(reqs), num_drafts, chain_kind(rows))

    def _draft_step(self, reqs: list[ScheduledRequest], committed, j: int, toks: list, sample: DeviceSample,
                    host: HostSample | None, live: list[int], filled: StaticStep | None = None):
        """The MTP forward producing draft j + 1: row at position committed + j − 1 with draft j.
        A static 'mtp' shape takes the positions on the device; otherwise they are read first.
        `filled`: the static step of draft j, whose tables serve every draft of the step (they
        were filled for the smallest start), so only its positions and tokens move."""
        step = filled
        if step is None and self.static is not None and reqs:
            step = self.static.prepare(_draft_rows(reqs), "mtp")
        if step is not None:
            step.advance(committed + (j - 1), toks[-1])
            return step, host
        assert not any(s.shift for s in reqs), "a shifted step drafts in static shapes (ModelRunner.runs_ahead)"
        if host is None and reqs:  # no static shape for these rows: read the acceptance counts now
            host = self._read(sample, None)
        starts = [s.end - s.num_draft + int(host.num_accepted[i]) + j - 1 for s, i in zip(reqs, live)] if reqs else []
        step = self._prepare([StepSeq(s.request.seq, p, [0]) for s, p in zip(reqs, starts)], "mtp")
        if reqs:
            step.set_token_ids(toks[-1])
        return step, host


def _draft_rows(reqs: list[ScheduledRequest]) -> list[StepSeq]:
    """The q = 1 rows of the draft forwards, each at the smallest start it may draft from (its
    tables then cover every draft position the acceptance count can lead to)."""
    return [StepSeq(s.request.seq, s.start + 1, [0]) for s in reqs]
