"""A step's MTP drafting as one static program: draft sampling and the draft forwards between
them, replayed as one CUDA graph per (batch size B, drafts k, sampling kind).

Without it, drafting k tokens runs k − 1 replays of the q = 1 MTP shape with the draft sampling
(softmax, shaping, noise, argmax: a few dozen kernels) eagerly between them. The chain keeps all
of it in static buffers of its B rows — the first draft's logits and streams, each row's
committed position, sampling parameters and seed — and drives the q = 1 MTP
shape itself: its tables are filled once per step (for the smallest start, so they cover every
draft's position) and each draft forward only moves positions and tokens, on the device.

The kind fixes the host-side branches of `probs_device` at capture: 'greedy' (every drafting row
greedy: one-hot drafts, no noise), 'sampled' (softmax at each row's temperature), 'shaped' (also
top-k / top-p / min-p). Rows with presence/frequency penalties draft eagerly instead (their counts
are per-step tensors). Padding rows (B above the live rows) sit at position 0 with all-zero
tables, so they touch only the dummy block. Off CUDA the same program runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ipc.messages import SamplingParams

from . import counter_rng
from .sampler import SamplingRows, probs_device, sample_device

KINDS = ("greedy", "sampled", "shaped")


def chain_kind(rows: SamplingRows) -> str:
    """The chain kind that computes these rows' drafts exactly as the eager loop would."""
    return "greedy" if rows.all_greedy else "shaped" if rows.any_shaping else "sampled"


@dataclass
class Chain:
    """The static buffers (and, on CUDA, the graph) of one (B, k, kind)."""

    shape: object  # the ('mtp', B, 1) Shape whose batch and inputs the chain drives
    num_drafts: int
    kind: str
    first_streams: torch.Tensor  # [B, hc, D]: the streams the first draft follows
    first_logits: torch.Tensor  # [B, V] fp32: the first draft's logits
    committed: torch.Tensor  # [B] int64: the position of the token the drafts follow (draft j at committed + j)
    rows: SamplingRows  # static per-row parameters, [B] each
    graph: "torch.cuda.CUDAGraph | None" = None
    tokens: torch.Tensor | None = None  # [B, k] outputs of the last run
    probs: torch.Tensor | None = None  # [B, k, V] (None for 'greedy')

    @classmethod
    def allocate(cls, shape, num_drafts: int, kind: str, vocab: int, like: "Chain | None" = None) -> "Chain":
        """`like`: a chain of the same shape whose input buffers this one shares (chains of one
        B run one at a time, and [B, V] logits per chain would add up)."""
        size, device = shape.batch.num_seqs, shape.inputs.device
        # B neutral (greedy) rows; `load` overwrites the live ones each run
        rows = SamplingRows([SamplingParams()] * size, [0] * size, [0] * size, device)
        rows.all_greedy, rows.any_shaping = kind == "greedy", kind == "shaped"
        if like is not None:
            return cls(shape, num_drafts, kind, like.first_streams, like.first_logits, like.committed, rows)
        return cls(shape, num_drafts, kind, torch.zeros_like(shape.inputs),
                   torch.zeros(size, vocab, dtype=torch.float32, device=device),
                   torch.zeros(size, dtype=torch.long, device=device), rows)

    def load(self, streams: torch.Tensor, logits: torch.Tensor, committed: torch.Tensor, seeds: torch.Tensor,
             rows: SamplingRows) -> None:
        """Copy the live rows' inputs (n ≤ B of each) in; padding rows go back to position 0."""
        n, static = streams.shape[0], self.rows
        self.first_streams[:n].copy_(streams)
        self.first_logits[:n].copy_(logits)
        self.committed.zero_()
        self.committed[:n].copy_(committed)
        static.seeds[:n].copy_(seeds)
        for name in ("temperature", "top_p", "min_p", "greedy", "top_k"):
            getattr(static, name)[:n].copy_(getattr(rows, name))

    def program(self, backend) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chain itself (what the graph records): k drafts [B, k] and their distributions."""
        shape, batch, rows = self.shape, self.shape.batch, self.rows
        streams, logits = self.first_streams, self.first_logits
        tokens, probs = [], []
        for j in range(1, self.num_drafts + 1):
            p = probs_device(logits, rows)
            keys = None if self.kind == "greedy" else counter_rng.row_keys(rows.seeds, self.committed + j,
                                                                           counter_rng.DRAFT)
            tokens.append(sample_device(p, keys))
            probs.append(p)
            if j == self.num_drafts:
                break
            # the forward drafting j + 1 is the row at committed + j − 1 reading draft j (as the
            # eager loop's StaticStep.advance): every row moves, padding included
            position = self.committed + (j - 1)
            batch.start.copy_(position)
            batch.positions.copy_(position)
            batch.token_ids.copy_(tokens[-1])
            shape.inputs.copy_(streams)
            streams, logits = backend._forward(shape)
        return torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if self.kind != "greedy" else None


class ChainStep:
    """A chain whose shape's tables hold this step's live rows."""

    def __init__(self, backend, chain: Chain, num_rows: int):
        self.backend, self.chain, self.num_rows = backend, chain, num_rows

    def run(self, streams: torch.Tensor, logits: torch.Tensor, committed: torch.Tensor, seeds: torch.Tensor,
            rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [n, hc, D] and logits [n, V] of the first draft, its positions and the rows'
        seeds [n], their sampling parameters → (drafts [n, k], their distributions [n, k, V] or
        None). Copies, not views: a request keeps its draft distributions until its next
        verification, and another step's run would overwrite the static outputs."""
        chain, n = self.chain, self.num_rows
        chain.load(streams, logits, committed, seeds, rows)
        self.backend.replay_chain(chain)
        probs = chain.probs[:n].clone() if chain.probs is not None else None
        return chain.tokens[:n].clone(), probs
