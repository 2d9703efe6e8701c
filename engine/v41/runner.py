"""The model runner of a V4.1 engine: ModelRunner's step (target forward → sample / verify), with
V4.1's forward over `Chunk`s and DSpark in place of MTP.

After the target forward every scheduled row's main hidden state feeds DSpark's stage windows
(per-request state in the window pool, by position), then every request that sampled drafts a
block after its newest token: anchor = the token just sampled at position e, drafted from the
windows up to position e − 1. Drafts are greedy (one-hot), so the shared verification
(engine/speculative.py) stays lossless for sampled requests too; the next step verifies them as
it verifies MTP drafts.

A uniform decode/verify step (every sequence its last q = 1 + drafts tokens) that the static
backend holds a shape for runs in static shapes (engine/v41/static_decode.py: a CUDA graph on
GPU), and so does its DSpark step, on the device from the sampled results: the step reads the
host once (sample and drafts together). Other steps, and every step while tracing or under
expert parallelism, run the eager per-chunk forward, whose drafting reads the sample first.

Images (DeepSeek-V4.1 vision): an eager step places the image rows its chunks cover
(engine/v41/vision/placement.py), each image encoded once through the runner's `EncoderCache`;
a step that holds any image position never runs in static shapes (they embed token ids only).

Under expert parallelism (lockstep) a step with no rows is a dummy one: zero rows through every
backbone MoE dispatch (engine/v41/expert_parallel.py `idle_forward`). DSpark's stages hold all
their experts on every rank, so drafting needs no agreement.
"""

from __future__ import annotations

import torch

from ..attention_backend import StepSeq
from ..model_runner import ModelRunner, Drafts
from .attention import Chunk
from .dspark import DSpark
from .expert_parallel import idle_forward
from .model import ForwardOut, V41Model
from .static_decode import V41StaticBackend, V41StaticStep
from .vision.encoder import EncoderCache
from .vision.placement import step_images

DECODER_TAIL_MODES = ("exact", "approx")


class V41Step:
    """One forward's chunks over the flattened tokens of its rows."""

    def __init__(self, rows: list[StepSeq], device: torch.device, trace: bool = False, lockstep: bool = False,
                 encoder_cache: EncoderCache | None = None):
        self.lockstep = lockstep  # expert parallel: an empty step still runs every MoE collective
        self.chunks, tokens, begin = [], [], 0
        for r in rows:
            n = len(r.token_ids)
            self.chunks.append(Chunk(r.seq, r.start, begin, n, trace={} if trace else None))
            tokens += r.token_ids
            begin += n
        self.host_ids = torch.tensor(tokens, dtype=torch.long)  # Engram hashes these on the host
        self.token_ids = self.host_ids.to(device)
        self.images = step_images(self.chunks, encoder_cache, device)  # None: no image position

    def run(self, model: V41Model, logit_rows: list[int] | None, inputs=None):
        """(ForwardOut or None when there are no rows, fp32 logits [len(logit_rows), V] or None)."""
        if not self.chunks:
            if self.lockstep:
                idle_forward(model)
            return None, None
        out = model(self.token_ids, self.chunks, self.host_ids, self.images)
        if not logit_rows:
            return out, None
        rows = torch.tensor(logit_rows, device=model.device)
        if out.kept is not None:  # the decoder tail kept only some rows; every logit row is among them
            rows = torch.searchsorted(out.kept, rows)
        return out, model.logits(out.x[rows])


class V41ModelRunner(ModelRunner):
    def __init__(self, model: V41Model, cache, num_speculative_tokens: int = 0, decoder_tail: str = "exact",
                 static: V41StaticBackend | None = None):
        super().__init__(model, cache, num_speculative_tokens, static)
        if decoder_tail not in DECODER_TAIL_MODES:
            raise ValueError(f"--decoder-tail must be one of {', '.join(DECODER_TAIL_MODES)}, got {decoder_tail!r}")
        block = model.cfg.v41.dspark_block_size
        if num_speculative_tokens > block:
            raise ValueError(f"--speculative-tokens {num_speculative_tokens} exceeds the DSpark block size {block}")
        self.dspark = DSpark(model) if num_speculative_tokens else None
        model.tail_rows = model.cfg.sliding_window if decoder_tail == "approx" else None
        self.backends = []
        self.trace = False  # tests: record every index source's selection per chunk
        self.last_step: V41Step | V41StaticStep | None = None
        self._lockstep = False  # the current launch's
        self._static_batch = False  # whether the current launch's target forward runs in static shapes
        self.num_static_steps = 0  # steps whose target forward ran in static shapes
        self.encoder_cache = EncoderCache(model.encoder) if model.encoder is not None else None

    def launch(self, batch, num_drafts: int | None = None, allow_static: bool = True, lockstep: bool = False,
               ahead=None):
        self._lockstep = lockstep
        self._static_batch = allow_static and not lockstep and self.static_ok(batch)
        return super().launch(batch, num_drafts, allow_static, lockstep, ahead)

    def _prepare(self, rows: list[StepSeq], kind: str = "model", allow_static: bool = True):
        step = self.static.prepare(rows) if allow_static and self._static_batch else None
        self.num_static_steps += step is not None
        self.last_step = step if step is not None else V41Step(rows, self.device, self.trace, self._lockstep,
                                                               self.encoder_cache)
        return self.last_step

    def static_ok(self, batch) -> bool:
        """A uniform decode/verify batch past position 0 that a static shape holds; never while
        tracing (the traces are the eager forward's), under expert parallelism (its dispatch) or
        over an image position (a prompt's last token can be one)."""
        if self.static is None or self.trace or any(b.ffn.parallel is not None for b in self.model.layers):
            return False
        return (super().static_ok(batch) and all(s.start > 0 for s in batch.scheduled)
                and not any(_meets_image(s.request.seq, s.start, s.end) for s in batch.scheduled))

    def _run_mtp(self, batch, out: ForwardOut | None, pending, sample, num_drafts: int, lockstep: bool, flow=None):
        """DSpark: observe this step's rows, then draft `num_drafts` tokens per sampling request
        after its last accepted token. Returns ModelRunner's (drafts, host sample read early).
        With a static backend the drafting runs on the device (its 'dspark' program), after a
        static step and after an eager one alike; without one it needs the accepted tokens on
        the host, read early (so no async scheduling: `flow` is None)."""
        assert flow is None, "V4.1 steps are not scheduled ahead"
        if isinstance(self.last_step, V41StaticStep):  # it observes, then drafts
            return self._drafts(self.last_step, out, pending, sample, num_drafts), None
        if out is None:
            return None, None
        self.dspark.observe(out.main_hidden, out.chunks)
        if not num_drafts or sample is None:
            return None, None
        step = self._draft_step(out, pending)
        if step is not None:
            return self._drafts(*step, pending, sample, num_drafts), None
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
        return Drafts(live, tokens, None), host  # greedy drafts: one-hot (no probabilities)

    def _draft_step(self, out: ForwardOut, pending) -> tuple[V41StaticStep, torch.Tensor] | None:
        """After an eager step: a static q = 1 step at each sampling request's last position
        before its drafts (the token there is known) and the main hidden rows of those positions,
        whose 'dspark' program drafts from the device results; None without a shape for them.
        Its observation rewrites the window rows the eager observation wrote there (same rows,
        row-independent ops: same bits), and its fill the Engram history there (same token)."""
        if self.static is None or not pending:
            return None
        chunk_of = {id(c.seq): c for c in out.chunks}
        rows, hidden = [], []
        for p in pending:
            s = p.sched
            position = s.end - s.num_draft - 1  # start + accepted is the drafts' anchor position
            if _meets_image(s.request.seq, position, position + 1):
                return None  # a static step embeds token ids only: draft eagerly
            chunk = chunk_of[id(s.request.seq)]
            rows.append(StepSeq(s.request.seq, position, [s.request.token_ids[position]]))
            hidden.append(chunk.begin + position - chunk.start)
        step = self.static.prepare(rows)
        if step is None:
            return None
        return step, out.main_hidden[torch.tensor(hidden, device=self.device)]

    def _drafts(self, step: V41StaticStep, main_hidden: torch.Tensor, pending, sample,
                num_drafts: int) -> Drafts | None:
        """Run a static step's DSpark program: every pending request drafts after the token its
        verification emitted (the anchor), at its position moved by its acceptance count."""
        accepted = sample.num_accepted  # [n]
        anchor = sample.emitted.gather(1, accepted[:, None])[:, 0]
        drafts = step.draft(main_hidden, accepted, anchor)  # [n, block]
        if not num_drafts:
            return None
        return Drafts(list(range(len(pending))), drafts[:, :num_drafts].contiguous(), None)


def _meets_image(seq, start: int, end: int) -> bool:
    """Whether positions [start, end) of the sequence include an image-span position."""
    images = getattr(seq, "multimodal", None)
    return images is not None and images.meets(start, end)
