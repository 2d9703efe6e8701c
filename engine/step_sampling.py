"""A step's sampling and verification on the device, and the step's one read back to the host.

Every request that reaches the end of its tokens samples: a plain decode row draws one token, a
verification (1 + d rows) runs rejection sampling over its d drafts (engine/speculative.py
`verify_batch`). All of them go through one batched pass in fixed shapes [P, Q] (Q = 1 + the
largest d, shorter requests padded): distributions (engine/sampler.py `probs_device`),
counter-based noise keyed by (request seed, token position, purpose) (engine/counter_rng.py),
logprobs when asked for. Nothing is read back until `start_read` and `PendingRead.wait`,
which copy the step's tokens, acceptance counts, finiteness flags, drafts and logprobs in one
transfer: the step's single host sync.
"""

from __future__ import annotations

import random
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from kernels import cpu_sampling

from . import counter_rng
from .output_counts import OutputCounts
from .sampler import SamplingRows, _to_device, probs_device, sample_device
from .speculative import verify_batch
from .structured.bitmask import apply_bitmask


@dataclass
class DeviceSample:
    """The device results of one step's sampling (no host values)."""

    emitted: torch.Tensor  # [P, Q] int64: accepted drafts, then the new token, then −1
    num_accepted: torch.Tensor  # [P] int64
    finite: torch.Tensor  # [P] bool: every logit of the request's rows is finite
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # chosen [P, Q], top ids/values [P, Q, N]
    host: "HostSample | None" = None  # the same values, when they were made on the host (no read needed)


@dataclass
class HostSample:
    """`DeviceSample` (and the step's drafts) read back."""

    emitted: np.ndarray  # [P, Q]
    num_accepted: np.ndarray  # [P]
    finite: np.ndarray  # [P] bool
    drafts: np.ndarray | None  # [R, k] drafts of the drafting requests
    chosen: np.ndarray | None  # [P, Q]
    top_ids: np.ndarray | None  # [P, Q, N]
    top_values: np.ndarray | None


class StepSampler:
    """Samples steps on `device`; a request without a seed gets a random one for its lifetime."""

    def __init__(self, device: torch.device):
        self.device = device
        self._seeds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.output_counts: OutputCounts | None = None  # made at the first request with penalties
        self._rng = random.Random()

    def seed_of(self, req) -> int:
        if req.params.seed is not None:
            return int(req.params.seed)
        seed = self._seeds.get(req)
        if seed is None:
            seed = self._seeds[req] = self._rng.getrandbits(63)
        return seed

    def sample(self, pending: list, logits: torch.Tensor, shifts: torch.Tensor | None = None,
               drafts_ahead: "AheadDrafts | None" = None) -> DeviceSample:
        """pending: each with `.sched` (ScheduledRequest) and `.logit_rows` (its 1 + d rows of
        `logits` [rows, V] fp32, the last of them the newest position). Async scheduling with
        speculation: `shifts` [P] adds to each request's positions (ScheduledRequest.shift), and
        the drafts of the requests in `drafts_ahead` are the step in flight's device tensors."""
        q_len = 1 + max(p.sched.num_draft for p in pending)
        if q_len == 1 and _plain_greedy_on_host(pending, logits):
            return _greedy_on_host(pending, logits)
        index, params, seeds, counters = [], [], [], []
        for p in pending:
            s, req = p.sched, p.sched.request
            rows = list(range(p.logit_rows.start, p.logit_rows.stop))
            index.append(rows + [rows[-1]] * (q_len - len(rows)))
            first = s.end - len(rows)  # position of the request's first logits row
            seed = self.seed_of(req)
            for j in range(q_len):
                params.append(req.params)
                seeds.append(seed)
                counters.append(first + j + 1)  # the position of the token this row produces
        sel = logits[_device_ints(index, self.device)]  # [P, Q, V]
        num, vocab = len(pending), logits.shape[-1]
        rows = SamplingRows(params, seeds, counters, self.device)
        if shifts is not None:  # the noise is keyed by the true positions
            rows.counters = rows.counters + shifts[:, None].expand(num, q_len).reshape(-1)
        drafts = num_drafts = draft_probs = None  # a step without drafts verifies nothing
        if q_len > 1:
            drafts, num_drafts, draft_probs = self._drafts(pending, q_len - 1, vocab, drafts_ahead)
        penalized = [i for i, p in enumerate(pending) if p.sched.request.params.has_penalties]
        if penalized:
            at = self._pending_index(penalized)
            slots, rows.penalty = self._penalties(pending, penalized, at, drafts, q_len, vocab)
        masked = self._apply_grammars(pending, sel, q_len)  # structured outputs; logprobs stay raw
        if q_len == 1:
            emitted, accepted = _draw(masked.view(num, vocab), rows)
        else:
            emitted, accepted = self._verify(masked, rows, drafts, num_drafts, draft_probs)
        if penalized:  # the next step's (and this step's drafts') penalties count these tokens
            self.output_counts.add(slots, emitted[at])
        finite = torch.isfinite(sel).flatten(1).all(dim=-1)
        return DeviceSample(emitted, accepted, finite, self._logprobs(pending, sel, emitted))

    @staticmethod
    def _verify(masked: torch.Tensor, rows: SamplingRows, drafts: torch.Tensor, num_drafts: torch.Tensor,
                draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(emitted [P, Q], num_accepted [P]) of a step with drafts: rejection sampling over the
        distributions of masked [P, Q, V]."""
        num, q_len, vocab = masked.shape
        probs = probs_device(masked.view(num * q_len, vocab), rows).view(num, q_len, vocab)
        counter_grid, seed_grid = rows.counters.view(num, q_len), rows.seeds.view(num, q_len)
        accept_u = counter_rng.uniform(counter_rng.row_keys(seed_grid[:, :-1].reshape(-1),
                                                            counter_grid[:, :-1].reshape(-1), counter_rng.ACCEPT))
        keys = _sample_keys(rows)
        return verify_batch(probs, drafts, draft_probs, num_drafts, accept_u.view(num, q_len - 1),
                            None if keys is None else keys.view(num, q_len))

    def _apply_grammars(self, pending: list, sel: torch.Tensor, q_len: int) -> torch.Tensor:
        """sel [P, Q, V] with every grammar-constrained row masked (engine/structured/): one
        bitmask row per constrained logits row, filled on the host, copied without blocking,
        applied on the device. sel itself when no request has an active grammar."""
        grammars = [(i, p) for i, p in enumerate(pending) if p.sched.request.grammar is not None]
        if not grammars:
            return sel
        import xgrammar as xgr

        num, vocab = sel.shape[0], sel.shape[-1]
        bitmask = xgr.allocate_token_bitmask(len(grammars) * q_len, vocab).numpy()  # [M, W] int32
        rows = []  # flat [P·Q] logits row of each bitmask row
        for i, p in grammars:
            s = p.sched
            drafts = s.request.draft_token_ids[: s.num_draft]
            start = len(rows)
            for j in s.request.grammar.fill(bitmask, start, drafts, 1 + s.num_draft):
                bitmask[len(rows)] = bitmask[start + j]
                rows.append(i * q_len + j)
        if not rows:
            return sel
        words = _to_device(torch.from_numpy(bitmask[: len(rows)]), self.device)
        index = _device_ints([rows], self.device)[0]
        return apply_bitmask(sel.reshape(num * q_len, vocab), words, index).view(num, q_len, vocab)

    def penalty_rows(self, reqs: list, vocab: int):
        """SamplingRows.penalty for MTP draft rows: (rows of the penalized requests [Rp], a copy
        of their counts [Rp, V], this step's tokens included; the drafting loop adds each draft
        to it); None if no request has penalties."""
        penalized = [i for i, req in enumerate(reqs) if req.params.has_penalties]
        if not penalized:
            return None
        counts = self._counts(vocab).rows(self.output_counts.slots([reqs[i] for i in penalized]))
        return self._pending_index(penalized), counts

    def _penalties(self, pending: list, penalized: list[int], at: torch.Tensor, drafts: torch.Tensor, q_len: int,
                   vocab: int):
        """(count rows of `penalized` [Pp], SamplingRows.penalty): the counts row j of a request
        penalizes with are its output counts plus its first j drafts. `at`: `penalized` on the
        device."""
        slots = self._counts(vocab).slots([pending[i].sched.request for i in penalized])
        base = self.output_counts.rows(slots)[:, None, :].expand(-1, q_len, -1)  # [Pp, Q, V]
        if q_len > 1:
            picked = drafts[at][..., None]  # [Pp, d, 1]
            seen = torch.zeros(len(penalized), q_len - 1, vocab, device=base.device).scatter_(2, picked, 1.0).cumsum(1)
            base = base + torch.cat((torch.zeros_like(seen[:, :1]), seen), dim=1)
        rows = (_device_ints([[i * q_len + j for i in penalized for j in range(q_len)]], self.device)[0])
        return slots, (rows, base.reshape(-1, vocab))

    def _counts(self, vocab: int) -> OutputCounts:
        if self.output_counts is None:
            self.output_counts = OutputCounts(vocab, self.device)
        return self.output_counts

    def _pending_index(self, indices: list[int]) -> torch.Tensor:
        return _device_ints([indices], self.device)[0]

    def _drafts(self, pending: list, d: int, vocab: int, ahead: "AheadDrafts | None"):
        """(drafts [P, d] int64, num_drafts [P], draft_probs [P, d, V] or None) on the device."""
        ahead_rows = ahead.rows if ahead is not None else {}
        # host drafts (placeholders: zeros, replaced below); one copy: the padded drafts [P, d] then the counts [P]
        tokens = [[0] * p.sched.num_draft if i in ahead_rows else p.sched.request.draft_token_ids[: p.sched.num_draft]
                  for i, p in enumerate(pending)]
        flat = [x for t in tokens for x in t + [0] * (d - len(t))] + [len(t) for t in tokens]
        grid = _device_ints([flat], self.device)[0]
        drafts, num_drafts = grid[: len(pending) * d].view(len(pending), d), grid[len(pending) * d :]
        if ahead_rows and d:
            drafts = drafts.clone()
            # an ahead row verifies every draft the step in flight proposed (num_draft = k)
            drafts[ahead.pending_index, : ahead.tokens.shape[1]] = ahead.tokens
        probs_of = [self._draft_probs(i, p.sched, ahead) for i, p in enumerate(pending)]
        if not d or all(probs is None for probs in probs_of):
            return drafts, num_drafts, None
        parts = []
        for i, p in enumerate(pending):
            s, probs = p.sched, probs_of[i]
            if probs is None:  # one-hot drafts (greedy) beside sampled ones
                probs = torch.zeros(s.num_draft, vocab, device=self.device).scatter_(
                    -1, drafts[i, : s.num_draft, None], 1.0)
            parts.append(torch.cat((probs.float(), probs.new_zeros(d - s.num_draft, vocab))) if s.num_draft < d else probs)
        return drafts, num_drafts, torch.stack(parts)

    @staticmethod
    def _draft_probs(i: int, s, ahead: "AheadDrafts | None") -> torch.Tensor | None:
        """Pending i's draft distributions [num_draft, V], or None for one-hot drafts."""
        if not s.num_draft or s.request.params.greedy:
            return None
        if ahead is not None and i in ahead.rows:
            return ahead.probs[ahead.rows[i]] if ahead.probs is not None else None
        return s.request.draft_probs[: s.num_draft] if s.request.draft_probs is not None else None

    @staticmethod
    def _logprobs(pending: list, sel: torch.Tensor, emitted: torch.Tensor):
        wants = [p.sched.request.params.logprobs for p in pending if p.sched.request.params.logprobs is not None]
        if not wants:
            return None
        logp = torch.log_softmax(sel.float(), dim=-1)  # the raw distribution, as vLLM reports it
        chosen = logp.gather(-1, emitted.clamp(min=0)[..., None]).squeeze(-1)
        top_n = max(wants)
        if not top_n:
            return chosen, None, None
        values, ids = logp.topk(top_n, dim=-1)
        return chosen, ids, values


def _plain_greedy_on_host(pending: list, logits: torch.Tensor) -> bool:
    """Whether a step without drafts is greedy argmax and nothing else: CPU fp32 logits, no
    penalties, grammars or logprobs."""
    if not (counter_rng.on_host(logits) and logits.dtype == torch.float32 and logits.is_contiguous()):
        return False
    for p in pending:
        req = p.sched.request
        if not req.params.greedy or req.params.has_penalties or req.grammar is not None or req.params.logprobs is not None:
            return False
    return True


def _greedy_on_host(pending: list, logits: torch.Tensor) -> DeviceSample:
    """The general path's DeviceSample for `_plain_greedy_on_host` steps in one numba pass per
    row (kernels/cpu_sampling.py: argmax and finiteness together), without gathering the rows.
    Its arrays are numpy's (torch wraps them without copies), so it carries its HostSample too:
    the read back has nothing to copy."""
    n = len(pending)
    rows = np.fromiter((p.logit_rows.stop - 1 for p in pending), np.int64, n)
    token, accepted, finite = np.empty((n, 1), np.int64), np.zeros(n, np.int64), np.empty(n, np.bool_)
    greedy = cpu_sampling.greedy_rows_parallel if n >= cpu_sampling.PARALLEL_GREEDY_ROWS else cpu_sampling.greedy_rows
    greedy(logits.numpy(), rows, token.reshape(n), finite)
    return DeviceSample(torch.from_numpy(token), torch.from_numpy(accepted), torch.from_numpy(finite), None,
                        HostSample(token, accepted, finite, None, None, None, None))


def _draw(logits: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
    """(emitted [P, 1], num_accepted [P] zeros) of a step without drafts, from logits [P, V]:
    what verify_batch gives with D = 0 (the race over each row's distribution under its SAMPLE
    key), in fewer ops. Greedy rows without penalties take the logits' argmax, which is the
    one-hot's (both the first maximum)."""
    if rows.all_greedy and rows.penalty is None:
        token = logits.argmax(-1)
    else:
        token = sample_device(probs_device(logits, rows), _sample_keys(rows))
    return token[:, None], torch.zeros_like(token)


def _sample_keys(rows: SamplingRows) -> torch.Tensor | None:
    """Each row's SAMPLE key [R] for the race; None when every row is one-hot (greedy)."""
    return None if rows.all_greedy else counter_rng.row_keys(rows.seeds, rows.counters, counter_rng.SAMPLE)


def _device_ints(rows: list[list[int]], device) -> torch.Tensor:
    t = torch.tensor(rows, dtype=torch.long)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t


@dataclass
class AheadDrafts:
    """Drafts a step verifies that the step in flight proposed (async scheduling with
    speculation): still on the device, never read by the host before this step runs."""

    rows: dict[int, int]  # pending index in this step → row of `tokens`
    pending_index: torch.Tensor  # [R] the same pending indices, on the device, in row order
    tokens: torch.Tensor  # [R, k] int64
    probs: torch.Tensor | None  # [R, k, V] (None: one-hot drafts)


@dataclass
class PendingRead:
    """The step's results on their way to the host: one int64 blob (pinned host memory on CUDA,
    copied without blocking and marked by `event`), and how to cut it."""

    blob: torch.Tensor  # [N] int64, on the host
    event: "torch.cuda.Event | None"
    sizes: list[int]
    emitted_shape: tuple | None
    drafts_shape: tuple | None
    logprob_shapes: tuple | None  # (chosen, top ids or None, top values or None)
    ready: HostSample | None = None  # a sample made on the host: nothing was copied, `wait` returns it

    def wait(self) -> HostSample:
        """Block until the copy has landed (the step's one host sync) and split it."""
        if self.ready is not None:
            return self.ready
        if self.event is not None:
            self.event.synchronize()
        parts = iter(_cut(self.blob.numpy(), self.sizes))
        emitted = accepted = finite = None
        if self.emitted_shape is not None:
            emitted = next(parts).reshape(self.emitted_shape)
            accepted, finite = next(parts), next(parts).astype(bool)
        drafts = next(parts).reshape(self.drafts_shape) if self.drafts_shape is not None else None
        chosen = top_ids = top_values = None
        if self.logprob_shapes is not None:
            chosen_shape, ids_shape, values_shape = self.logprob_shapes
            chosen = next(parts).view(np.float64).reshape(chosen_shape)
            if ids_shape is not None:
                top_ids = next(parts).reshape(ids_shape)
                top_values = next(parts).view(np.float64).reshape(values_shape)
        return HostSample(emitted, accepted, finite, drafts, chosen, top_ids, top_values)


def _cut(blob: np.ndarray, sizes: list[int]):
    """Consecutive views of blob, sizes[i] elements each (np.split's result, without its
    per-call array work: this runs once per step)."""
    start = 0
    for size in sizes:
        yield blob[start : start + size]
        start += size


def start_read(sample: DeviceSample | None, drafts: torch.Tensor | None) -> PendingRead | None:
    """Start copying everything the host needs from the step to the host, as one transfer. On
    CUDA it goes to pinned memory without blocking, so the host can schedule and launch the next
    step before `PendingRead.wait`."""
    if sample is None and drafts is None:
        return None
    if drafts is None and sample.host is not None:
        return PendingRead(None, None, [], None, None, None, ready=sample.host)
    ints = []
    if sample is not None:
        ints += [sample.emitted.flatten(), sample.num_accepted, sample.finite.long()]
    if drafts is not None:
        ints.append(drafts.long().flatten())
    lp = sample.logprobs if sample is not None else None
    if lp is not None:
        ints.append(lp[0].double().flatten().view(torch.long))
        if lp[1] is not None:
            ints += [lp[1].flatten(), lp[2].double().flatten().view(torch.long)]
    blob, event = torch.cat(ints), None
    if blob.is_cuda:
        host = torch.empty(blob.shape, dtype=blob.dtype, pin_memory=True)
        host.copy_(blob, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        blob = host
    shapes = None
    if lp is not None:
        shapes = (tuple(lp[0].shape), None if lp[1] is None else tuple(lp[1].shape),
                  None if lp[2] is None else tuple(lp[2].shape))
    return PendingRead(blob, event, [t.numel() for t in ints],
                       tuple(sample.emitted.shape) if sample is not None else None,
                       tuple(drafts.shape) if drafts is not None else None, shapes)

