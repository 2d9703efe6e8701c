"""The model runner of a V4.1 engine: ModelRunner's step (target forward → sample / verify), with
V4.1's forward over `Chunk`s and DSpark in place of MTP.

After the target forward every scheduled row's main hidden state feeds DSpark's stage windows
(per-request state in the window pool, by position), then every request that sampled drafts a
block after its newest token: anchor = the token just sampled at position e, drafted from the
windows up to position e − 1. Drafts are greedy (one-hot), so the shared verification
(engine/speculative.py) stays lossless for sampled requests too; the next step verifies them as
it verifies MTP drafts.
"""

from __future__ import annotations

import torch

from ..attention_backend import StepSeq
from ..model_runner import ModelRunner
from .attention import Chunk
from .dspark import DSpark
from .model import ForwardOut, V41Model

DECODER_TAIL_MODES = ("exact", "approx")


class V41Step:
    """One forward's chunks over the flattened tokens of its rows."""

    def __init__(self, rows: list[StepSeq], device: torch.device, trace: bool = False):
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

    def _prepare(self, rows: list[StepSeq], kind: str = "model", allow_static: bool = True) -> V41Step:
        self.last_step = V41Step(rows, self.device, self.trace)
        return self.last_step

    def static_ok(self, batch) -> bool:
        return False

    def _run_mtp(self, batch, out: ForwardOut | None, outputs, num_drafts: int, lockstep: bool) -> None:
        """DSpark: observe this step's rows, then draft `num_drafts` tokens per sampling request."""
        if out is None:
            return
        self.dspark.observe(out.main_hidden, out.chunks)
        if not num_drafts:
            return
        for s in batch.scheduled:
            req = s.request
            o = outputs.get(req.request_id)
            if o is None or o.error:
                continue
            computed = s.num_tokens - (s.num_draft - (len(o.accepted) - 1))  # rows whose KV stays
            draft = self.dspark.draft(req.seq, o.accepted[-1], s.start + computed - 1)
            tokens = draft.tokens[:num_drafts]
            if self.draft_override is not None:
                tokens = self.draft_override(req, o.accepted, tokens)
            o.drafts = list(tokens[:num_drafts])
            o.draft_probs = None  # greedy drafts: one-hot
