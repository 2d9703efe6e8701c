"""The model runner of a V4.1 engine: ModelRunner's step (target forward → sample / verify), with
V4.1's forward over `Chunk`s and DSpark in place of MTP.

After the target forward every scheduled row's main hidden state feeds DSpark's stage windows
(per-request state in the window pool, by position), then every request that sampled drafts a
block after its newest token: anchor = the token just sampled at position e, drafted from the
windows up to position e − 1. Drafts are greedy (one-hot), so the shared verification
(engine/speculative.py) stays lossless for sampled requests too; the next step verifies them as
it verifies MTP drafts.

Under expert parallelism (lockstep) a step with no rows is a dummy one: zero rows through every
backbone MoE dispatch (engine/v41/expert_parallel.py `idle_forward`). DSpark's stages hold all
their experts on every rank, so drafting needs no agreement.
"""

from __future__ import annotations

import torch

from ..attention_backend import StepSeq
from ..model_runner import ModelRunner, _Drafts
from .attention import Chunk
from .dspark import DSpark
from .expert_parallel import idle_forward
from .model import ForwardOut, V41Model

DECODER_TAIL_MODES = ("exact", "approx")


class V41Step:
    """One forward's chunks over the flattened tokens of its rows."""

    def __init__(self, rows: list[StepSeq], device: torch.device, trace: bool = False, lockstep: bool = False):
        self.lockstep = lockstep  # expert parallel: an empty step still runs every MoE collective
        self.chunks, tokens, begin = [], [], 0
        for r in rows:
            n = len(r.token_ids)
            self.chunks.append(Chunk(r.seq, r.start, begin, n, trace={} if trace else None))
            tokens += r.token_ids
            begin += n
        self.token_ids = torch.tensor(tokens, dtype=torch.long, device=device)

    def run(self, model: V41Model, logit_rows: list[int] | None, inputs=None):
        """(ForwardOut or None when there are no rows, fp32 logits [len(logit_rows), V] or None)."""
        if not self.chunks:
            if self.lockstep:
                idle_forward(model)
            return None, None
        out = model(self.token_ids, self.chunks)
        if not logit_rows:
            return out, None
        rows = torch.tensor(logit_rows, device=model.device)
        if out.kept is not None:  # the decoder tail kept only some rows; every logit row is among them
            rows = torch.searchsorted(out.kept, rows)
        return out, model.logits(out.x[rows])


class V41ModelRunner(ModelRunner):
    def __init__(self, model: V41Model, cache, num_speculative_tokens: int = 0, decoder_tail: str = "exact"):
        super().__init__(model, cache, num_speculative_tokens, None)
        if decoder_tail not in DECODER_TAIL_MODES:
            raise ValueError(f"--decoder-tail must be one of {', '.join(DECODER_TAIL_MODES)}, got {decoder_tail!r}")
        block = model.cfg.v41.dspark_block_size
        if num_speculative_tokens > block:
            raise ValueError(f"--speculative-tokens {num_speculative_tokens} exceeds the DSpark block size {block}")
        self.dspark = DSpark(model) if num_speculative_tokens else None
        model.tail_rows = model.cfg.sliding_window if decoder_tail == "approx" else None
        self.backends = []
        self.trace = False  # tests: record every index source's selection per chunk
        self.last_step: V41Step | None = None
        self._lockstep = False  # the current execute's

    def execute(self, batch, num_drafts: int | None = None, allow_static: bool = True, lockstep: bool = False):
        self._lockstep = lockstep
        return super().execute(batch, num_drafts, allow_static=allow_static, lockstep=lockstep)

    def _prepare(self, rows: list[StepSeq], kind: str = "model", allow_static: bool = True) -> V41Step:
        self.last_step = V41Step(rows, self.device, self.trace, self._lockstep)
        return self.last_step

    def static_ok(self, batch) -> bool:
        return False

    def _run_mtp(self, batch, out: ForwardOut | None, pending, sample, num_drafts: int, lockstep: bool, flow=None):
        """DSpark: observe this step's rows, then draft `num_drafts` tokens per sampling request
        after its last accepted token. Returns ModelRunner's (drafts, host sample read early):
        drafting needs the accepted tokens on the host (so no async scheduling: `flow` is None)."""
        assert flow is None, "V4.1 steps are not scheduled ahead"
        if out is None:
            return None, None
        self.dspark.observe(out.main_hidden, out.chunks)
        if not num_drafts or sample is None:
            return None, None
        host = self._read(sample, None)
        live, blocks = [], []
        for i, p in enumerate(pending):
            if not host.finite[i]:
                continue
            s, n = p.sched, int(host.num_accepted[i]) + 1
            computed = s.num_tokens - (s.num_draft - (n - 1))  # rows whose KV stays
            draft = self.dspark.draft(s.request.seq, int(host.emitted[i, n - 1]), s.start + computed - 1)
            live.append(i)
            blocks.append(draft.tokens[:num_drafts])
        if not live:
            return None, host
        tokens = torch.tensor(blocks, dtype=torch.long, device=self.device)  # [R, num_drafts]
        return _Drafts(live, tokens, None), host  # greedy drafts: one-hot (no probabilities)
