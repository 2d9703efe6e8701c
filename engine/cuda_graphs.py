"""The static-shape attention backend: decode and verify steps, and MTP draft steps, replayed
from CUDA graphs (see engine/attention_backend.py for the backend interface).

A shape is (kind, batch size B, tokens per sequence q, context bucket C): kind 'model' (the
target model's decode/verify step) or 'mtp' (one application of the MTP layer to the previous
draft, q = 1, window attention only); B from `--cuda-graph-sizes`,
q = 1 (decode) and 1 + k (verify with k drafts), C a power-of-4 ladder of block multiples up to
the model length (the entry axis of the compressed attention is C / ratio long, so short
contexts do not pay for long ones). A live batch of n ≤ B sequences replays the smallest shape
that fits; its rows past n are padding that touch only the dummy block. Batches larger than
the largest size, mixed prefill/decode steps and non-uniform q run eagerly instead. Drafting
chains (engine/draft_chain.py) drive the q = 1 MTP shapes: k drafts and the k − 1 draft forwards
between them, one graph per (B, k ≥ 2, sampling kind).

On a GPU every shape is captured at start-up (largest first, one shared memory pool), after
two eager warm-up runs on a side stream so that lazy initialisation (kernel compilation,
cuBLAS workspaces) happens outside capture. Elsewhere the same static-shape forward runs
eagerly, which is how CPU tests check it against the per-sequence path.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from .attention_backend import StepSeq
from .decode_batch import DecodeBatch
from .draft_chain import KINDS as CHAIN_KINDS
from .draft_chain import Chain, ChainStep
from .kv_cache import KVCache
from .v4.fused_decode import FusedDecoder
from .v4.model import DeepseekV4

logger = logging.getLogger(__name__)


def context_buckets(block_size: int, max_model_len: int) -> list[int]:
    """Context capacities (block multiples) ×4 apart from 4 blocks up to the model length."""
    top = -(-max_model_len // block_size) * block_size
    buckets, c = [], 4 * block_size
    while c < top:
        buckets.append(c)
        c *= 4
    return buckets + [top]


Key = tuple[str, int, int, int]  # (kind, B, q, C)


@dataclass
class Shape:
    batch: DecodeBatch
    inputs: torch.Tensor | None = None  # 'mtp': [B·q, n, D] the target's / previous draft's streams (static)
    graph: "torch.cuda.CUDAGraph | None" = None
    streams: torch.Tensor | None = None  # [B·q, n, D] outputs of the last run (static under a graph)
    logits: torch.Tensor | None = None  # [B·q, vocab] fp32


class StaticStep:
    """A prepared static-shape step: its shape's buffers hold the live rows, padding after them."""

    def __init__(self, backend: "StaticDecodeBackend", shape: Shape, num_rows: int):
        self.backend, self.shape, self.num_rows = backend, shape, num_rows

    def set_token_ids(self, token_ids: torch.Tensor) -> None:
        """The live rows' token ids [n·q] from a device tensor (tokens sampled on the device)."""
        self.shape.batch.token_ids[: token_ids.shape[0]].copy_(token_ids)

    def advance(self, start: torch.Tensor, token_ids: torch.Tensor) -> None:
        """A q = 1 step whose positions are known on the device only: live row i at position
        start[i] with token token_ids[i]. Its tables were filled for a start no larger (so they
        cover every position it can now reach)."""
        batch, n = self.shape.batch, start.shape[0]
        assert batch.tokens_per_seq == 1 and n == self.num_rows
        batch.start[:n].copy_(start)
        batch.positions[:n].copy_(start)
        batch.token_ids[:n].copy_(token_ids)

    def shift(self, offsets: torch.Tensor) -> None:
        """Move live row i's positions by offsets[i] ≥ 0, known on the device only (async
        scheduling with speculation: how many drafts the step in flight accepts). The tables
        were filled for the unshifted start and reach its largest shift (prepare's `reach`)."""
        batch, n = self.shape.batch, self.num_rows
        batch.start[:n] += offsets
        q = batch.tokens_per_seq
        batch.positions[: n * q] += offsets[:, None].expand(n, q).reshape(-1)  # (no repeat_interleave: it may sync)

    def run_greedy(self, steps: int, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Up to `steps` greedy decode steps of the live rows in one call (the CPU's compiled
        step: FusedDecoder.greedy_steps): (tokens [n, done] int64, finite [n] bool), or None
        where no compiled step covers the shape (run the single step). stops [n, S] int64:
        each row's stop ids, −1 padding. The shape's tables must reach start + steps."""
        return self.backend.run_greedy(self.shape, steps, self.num_rows, stops)

    def run(self, model, logit_rows: list[int] | None, inputs: torch.Tensor | None = None):
        """Streams [n·q, hc, D] of the live rows and the logits of `logit_rows` (None: all):
        views of static outputs where possible, valid until the next run. 'mtp' shapes take the
        previous draft's streams `inputs` [n, hc, D]. The graph computes every row's logits; rows
        are increasing, so asking for n of n rows means all of them."""
        shape = self.shape
        if shape.inputs is not None:
            shape.inputs[: inputs.shape[0]].copy_(inputs)
        self.backend.replay(shape)
        n = self.num_rows * shape.batch.tokens_per_seq
        logits = shape.logits[:n] if logit_rows is None or len(logit_rows) == n else shape.logits[logit_rows]
        return shape.streams[:n], logits


class StaticDecodeBackend:
    def __init__(self, model: DeepseekV4, cache: KVCache, batch_sizes: tuple[int, ...],
                 tokens_per_seq: tuple[int, ...], max_model_len: int, capture: bool, draft_steps: bool = False,
                 fused: bool = True, decode_steps: int = 1):
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"--cuda-graph-sizes must be positive batch sizes, got {list(batch_sizes)}")
        self.model, self.cache = model, cache
        self.batch_sizes = sorted(set(batch_sizes))
        self.tokens_per_seq = sorted(set(tokens_per_seq))
        self.draft_steps = draft_steps and len(model.mtp) > 0  # also the MTP layer's draft steps
        b = cache.layout.block_size
        self.buckets = context_buckets(b, max_model_len)
        # Sliding blocks a table can hold at a step: the kept window plus the step (its q tokens,
        # or the `decode_steps` greedy steps of one call), across block edges.
        self.sliding_blocks = -(-(cache.manager.keep + 2 * max(*self.tokens_per_seq, decode_steps)) // b) + 2
        self.capture = capture and torch.device(cache.device).type == "cuda"
        # The forward a shape runs: the fused kernels (engine/v4/fused_decode.py; Triton on CUDA,
        # the CPU kernels on CPU) or the torch static path (engine/v4/attention_decode.py).
        self.fused = FusedDecoder(model) if fused else None
        self._shapes: dict[Key, Shape] = {}
        self._chains: dict[tuple[int, int, str], Chain] = {}  # (B, drafts, kind) → the drafting chain
        self._pool = None
        self.num_runs = 0  # static-shape steps run
        self.num_replays = 0  # of which replayed from a captured graph

    # ---- shape choice ------------------------------------------------------------------------
    def shape_for(self, num_seqs: int, q: int, max_end: int) -> Key | None:
        """The smallest target-model shape holding `num_seqs` sequences reaching position
        `max_end`, or None (run eagerly)."""
        if q not in self.tokens_per_seq:
            return None
        size = next((s for s in self.batch_sizes if s >= num_seqs), None)
        bucket = next((c for c in self.buckets if c >= max_end), None)
        if size is None or bucket is None:
            return None
        return "model", size, q, bucket

    def mtp_shape_for(self, num_seqs: int, q: int = 1) -> Key | None:
        """The smallest MTP shape for `num_seqs` sequences of q tokens (q = 1: a draft step; the
        catch-up after a verify step: 1 + drafts), or None. It reads only its window, so any
        context fits the smallest bucket."""
        if not self.draft_steps or (q != 1 and q not in self.tokens_per_seq):
            return None
        size = next((s for s in self.batch_sizes if s >= num_seqs), None)
        return None if size is None else ("mtp", size, q, self.buckets[0])

    def prepare(self, rows: list[StepSeq], kind: str = "model", reach: int | None = None) -> StaticStep | None:
        """Fill the smallest shape that holds these rows (all with the same number q of tokens),
        or None when none does (mixed lengths, too many rows, a context beyond the buckets).
        `reach`: the furthest end a row's positions may get to once shifted (StaticStep.shift)."""
        q = len(rows[0].token_ids)
        if any(len(r.token_ids) != q for r in rows):
            return None
        if kind == "mtp":
            key = self.mtp_shape_for(len(rows), q)
        else:
            key = self.shape_for(len(rows), q, max(max(r.start for r in rows) + q, reach or 0))
        if key is None:
            return None
        shape = self._get(key)
        self._fill(shape.batch, rows)
        return StaticStep(self, shape, len(rows))

    def _fill(self, batch: DecodeBatch, rows: list[StepSeq]) -> None:
        """Copy the live rows into a shape's tables (an architecture may add its own fields)."""
        batch.fill([self._row(r, batch) for r in rows])

    def padding_step(self, kind: str = "model") -> StaticStep | None:
        """The smallest shape of `kind` with every row padding: a lockstep rank's dummy step,
        which runs the same collectives (the padded all-to-all's buffers do not depend on the
        shape) and touches only the dummy block."""
        key = self.shape_for(1, 1, 1) if kind == "model" else self.mtp_shape_for(1)
        if key is None:
            return None
        shape = self._get(key)
        shape.batch.fill([])
        return StaticStep(self, shape, 0)

    # ---- drafting chains (engine/draft_chain.py) ------------------------------------------------
    def chain_depths(self) -> list[int]:
        """Draft counts a chain serves: those a step may propose, from 2 (one draft has no
        draft forward)."""
        return [q - 1 for q in self.tokens_per_seq if q - 1 >= 2] if self.draft_steps else []

    def draft_chain(self, rows: list[StepSeq], num_drafts: int, kind: str) -> ChainStep | None:
        """The chain drafting `num_drafts` tokens for these q = 1 rows (each at the smallest
        start it may draft from), its shape's tables filled; None when none serves them."""
        if num_drafts not in self.chain_depths():
            return None
        key = self.mtp_shape_for(len(rows), 1)
        if key is None:
            return None
        shape = self._get(key)
        chain = self._chain(shape, key[1], num_drafts, kind)
        shape.batch.fill([self._row(r, shape.batch) for r in rows])
        return ChainStep(self, chain, len(rows))

    def _chain(self, shape: Shape, size: int, num_drafts: int, kind: str) -> Chain:
        chain = self._chains.get((size, num_drafts, kind))
        if chain is None:
            like = next((c for (s, _, _), c in self._chains.items() if s == size), None)
            chain = self._chains[(size, num_drafts, kind)] = Chain.allocate(shape, num_drafts, kind,
                                                                            self.model.cfg.vocab_size, like)
            if self.capture:
                self._capture_chain(chain)
        return chain

    @torch.inference_mode()
    def replay_chain(self, chain: Chain) -> None:
        """Run a loaded chain: replay its graph, or its program eagerly when uncaptured."""
        out = self._run(chain.graph, lambda: chain.program(self))
        if out is not None:
            chain.tokens, chain.probs = out

    def _capture_chain(self, chain: Chain) -> None:
        chain.graph, (chain.tokens, chain.probs) = self._record(lambda: chain.program(self))

    def _get(self, key: Key) -> Shape:
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = self._allocate(key)
            if self.capture:
                self._capture(shape)
        return shape

    def _allocate(self, key: Key) -> Shape:
        """A shape's static buffers, all rows padding."""
        kind, size, q, bucket = key
        batch = DecodeBatch.allocate(self.cache, size, q, bucket // self.cache.layout.block_size, self.sliding_blocks)
        shape = Shape(batch)
        if kind == "mtp":
            cfg = self.model.cfg
            shape.inputs = torch.zeros(size * q, cfg.hc_mult, cfg.hidden_size, dtype=self.model.dtype,
                                       device=self.cache.device)
        return shape

    # ---- running -----------------------------------------------------------------------------
    @torch.inference_mode()
    def replay(self, shape: Shape) -> None:
        """Run a filled shape: replay its graph, or its static forward eagerly when uncaptured."""
        out = self._run(shape.graph, lambda: self._forward(shape))
        if out is not None:
            shape.streams, shape.logits = out

    @torch.inference_mode()
    def run_greedy(self, shape: Shape, steps: int, live: int, stops: np.ndarray):
        """StaticStep.run_greedy: None unless a compiled CPU step runs this target shape."""
        if self.fused is None or shape.inputs is not None or shape.graph is not None:
            return None
        out = self.fused.greedy_steps(shape.batch, steps, live, stops)
        if out is not None:
            self.num_runs += 1
        return out

    def _run(self, graph, program):
        """Replay `graph` (its outputs stay where capture put them: None), or run `program` eagerly
        and return its outputs."""
        self.num_runs += 1
        if graph is None:
            return program()
        graph.replay()
        self.num_replays += 1
        return None

    def _row(self, row: StepSeq, batch: DecodeBatch):
        """The part of a sequence's tables this step reads: full blocks from 0 up to the shape's
        context, sliding blocks from the one holding position start − keep (what the block
        manager keeps readable) on. Tables may hold more (blocks allocated for drafts)."""
        table, b = row.seq.table, self.cache.layout.block_size
        first = max(table.sliding_first, max(0, row.start - self.cache.manager.keep) // b)
        skip = first - table.sliding_first
        sliding = table.sliding[skip : skip + batch.sliding_table.shape[1]]
        return row.token_ids, row.start, table.full[: batch.full_table.shape[1]], sliding, first

    def _forward(self, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
        batch, fused = shape.batch, self.fused
        if shape.inputs is None:
            if fused:  # the CPU's compiled step covers the LM head too (one call, logits within 1e-5)
                return fused.forward_logits(batch)
            streams = self.model(batch.token_ids, batch.positions, batch)
            return streams, self.model.logits(streams)
        mtp = self.model.mtp[0]
        if fused:
            streams = fused.forward_mtp(shape.inputs, batch)
        else:
            streams = mtp(self.model, shape.inputs, batch.token_ids, batch.positions, batch)
        return streams, mtp.logits(self.model, streams)

    # ---- capture (CUDA only) -----------------------------------------------------------------
    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every shape, largest first so smaller graphs reuse the shared pool."""
        if not self.capture:
            return 0
        keys = self._capture_keys()
        free_before, t0 = torch.cuda.mem_get_info()[0], time.perf_counter()
        for key in sorted(keys, key=lambda k: k[1:], reverse=True):
            self._get(key)
        for size in sorted(self.batch_sizes, reverse=True):  # after the shapes whose buffers they drive
            for num_drafts in self.chain_depths():
                for kind in CHAIN_KINDS:
                    self._chain(self._get(("mtp", size, 1, self.buckets[0])), size, num_drafts, kind)
        keys += list(self._chains)
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        # Operators size --kv-cache-memory around this: graph memory is not taken from the KV pools.
        logger.info("captured %d CUDA graphs in %.1f s using %.2f GiB (sizes %s, q %s, contexts %s, MTP draft "
                    "steps %s)", len(keys), time.perf_counter() - t0, used / 2**30, self.batch_sizes,
                    self.tokens_per_seq, self.buckets, self.draft_steps)
        return len(keys)

    def _capture_keys(self) -> list[Key]:
        """Every shape a step may run (captured at start-up)."""
        keys = [("model", s, q, c) for c in self.buckets for q in self.tokens_per_seq for s in self.batch_sizes]
        if self.draft_steps:
            keys += [("mtp", s, q, self.buckets[0]) for q in sorted({1, *self.tokens_per_seq}) for s in self.batch_sizes]
        return keys

    def _capture(self, shape: Shape) -> None:
        # All-padding buffers: warm-up and capture write only the dummy block.
        shape.graph, (shape.streams, shape.logits) = self._record(lambda: self._forward(shape))

    def _record(self, program):
        """(graph, outputs) of `program` captured in the shared pool, after two eager warm-up runs
        on a side stream (lazy initialisation happens outside capture)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                program()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = program()
        self._pool = graph.pool()
        return graph, outputs
