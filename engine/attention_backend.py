"""Attention backends: how a forward pass over some sequences finds and writes their KV.

A backend turns one forward's sequences (`StepSeq`: KV state, first position, tokens) into a
step context (`prepare`), or declines (None) when it cannot run that step. The context is what
the model's attention layers call (`attend`, see engine/v4/attention.py) and what the model runner
runs (`run`: the target model, or the MTP layer when given input streams, then the logits of
the rows that need them). Two backends exist:

  * `SequenceBackend` (here): per-sequence varlen attention, any mix of prefill chunks,
    decodes and verifications; always accepts.
  * `StaticDecodeBackend` (engine/cuda_graphs.py): static-shape decode/verify (and MTP draft)
    steps, captured once as CUDA graphs on GPU and replayed (`capture_all`); declines mixed steps
    and shapes it does not hold.

The model runner asks them in that order of preference (static first) and never branches on
which one answered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .v4.attention import SeqSlice, SequenceContext


@dataclass(slots=True)
class StepSeq:
    """One sequence's share of a forward: positions [start, start + len(token_ids))."""

    seq: object  # PagedSequence (or a dense SequenceState)
    start: int
    token_ids: list[int]  # MTP forwards: the token after each position


class SequenceStep(SequenceContext):
    """A prepared per-sequence step: the flattened tokens and positions plus their SeqSlices."""

    def __init__(self, rows: list[StepSeq], device: torch.device):
        seqs, tokens, positions, begin = [], [], [], 0
        for r in rows:
            n = len(r.token_ids)
            tokens += r.token_ids
            positions += range(r.start, r.start + n)
            seqs.append(SeqSlice(r.seq, r.start, begin, n))
            begin += n
        super().__init__(seqs)
        self.token_ids = torch.tensor(tokens, dtype=torch.long, device=device)  # [T]
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)  # [T]

    def set_token_ids(self, token_ids: torch.Tensor) -> None:
        """Replace the step's token ids [T] by a device tensor (tokens sampled on the device)."""
        self.token_ids = token_ids.to(torch.long)

    def run(self, model, logit_rows: list[int] | None, inputs: torch.Tensor | None = None):
        """(streams [T, n, D], logits [len(logit_rows), V] fp32 or None). With `inputs` (the
        target's streams at these positions) the step runs the MTP layer instead of the model."""
        if inputs is None:
            streams = model(self.token_ids, self.positions, self)
            head = model.logits
        else:
            mtp = model.mtp[0]
            streams = mtp(model, inputs, self.token_ids, self.positions, self)
            head = lambda s: mtp.logits(model, s)  # noqa: E731
        logits = head(streams[logit_rows]) if logit_rows else None
        return streams, logits


class SequenceBackend:
    def __init__(self, device: torch.device):
        self.device = device

    def prepare(self, rows: list[StepSeq], kind: str = "model") -> SequenceStep:
        return SequenceStep(rows, self.device)
