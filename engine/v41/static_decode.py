"""DeepSeek-V4.1's static-shape decode/verify step, on V4's static backend (engine/cuda_graphs.py).

A shape is V4's (kind, batch size B, tokens per sequence q, context bucket C), its tables a
`DecodeBatch` with one V4.1 field: the Engram hash ids [B·q, n_engram_layers, cols], computed on
the host from the step's token ids when the step is filled (the host has them: known tokens and
the drafts it read back), so the forward never reads token ids back. Kinds:
  * 'model'  the target forward (engine/v41/static_forward.py): DSpark's main hidden rows and
             every row's logits;
  * 'dspark' DSpark observing the step's rows, then drafting a block per sequence from the
             step's device results (engine/v41/static_dspark.py). It shares the tables of the
             'model' shape of the same (B, q, C), so a verify step fills one table and reads the
             host once: sample and drafts together.
On a GPU both are captured at start-up (`capture_all`) and replayed; elsewhere the same static
programs run eagerly. Padding rows (B above the live batch) sit at position 0 with all-zero
tables and touch only the dummy block.

CPU: the eager path stays the default there (`build_static_backend`). Under the reference
numerics it reproduces REF's CPU roundings per chunk (torch.topk's tie choices at the row's own
width, attention sums over the row's own key count), which fixed widths cannot;
EngineConfig(static_decode=True) selects this path on a CPU explicitly (the tests do, against the
golden data and the eager path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention_backend import StepSeq
from ..cuda_graphs import Key, Shape, StaticDecodeBackend, StaticStep
from ..decode_batch import DecodeBatch
from . import numerics as nx
from .static_dspark import draft, observe
from .static_forward import StepContext, row_groups, static_forward, static_logits


@dataclass
class _ModelShape(Shape):
    engram_rows: list[torch.Tensor] | None = None  # per Engram layer [B·q, cols, head_dim], host tables only


@dataclass
class _DraftShape(Shape):
    accepted: torch.Tensor | None = None  # [B] int64: drafts each sequence's verification accepted
    anchor: torch.Tensor | None = None  # [B] int64: the token it emitted after them


class V41StaticStep(StaticStep):
    """A filled 'model' shape; `draft` runs DSpark on the same tables."""

    def __init__(self, backend: "V41StaticBackend", shape: Shape, num_rows: int, key: Key):
        super().__init__(backend, shape, num_rows)
        self.key = key

    def draft(self, main_hidden: torch.Tensor, accepted: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """Observe this step's rows (main_hidden [n·q, ...], its `run` output) and draft a block
        after each live sequence's last accepted token (accepted, anchor: [n] int64 on the
        device) → drafts [n, block] (a copy: the next step's run rewrites the static output)."""
        n, shape = self.num_rows, self.backend._get(("dspark", *self.key[1:]))
        shape.inputs[: main_hidden.shape[0]].copy_(main_hidden)
        for static, live in ((shape.accepted, accepted), (shape.anchor, anchor)):
            static.zero_()  # padding rows: position 0, token 0
            static[:n].copy_(live)
        self.backend.replay(shape)
        return shape.streams[:n].clone()


class V41StaticBackend(StaticDecodeBackend):
    def __init__(self, model, cache, batch_sizes: tuple[int, ...], tokens_per_seq: tuple[int, ...],
                 max_model_len: int, capture: bool, dspark: bool):
        super().__init__(model, cache, batch_sizes, tokens_per_seq, max_model_len, capture, draft_steps=False,
                         fused=False)
        self.dspark = dspark and len(model.mtp) > 0
        v = model.cfg.v41
        self._engram = [model.layers[i].engram for i in v.engram_layer_ids] if model.hasher is not None else []
        self._host_tables = any(e.embed.weight.device != model.device for e in self._engram)

    # ---- filling ------------------------------------------------------------------------------
    def prepare(self, rows: list[StepSeq], kind: str = "model", reach: int | None = None) -> V41StaticStep | None:
        """Fill the smallest target shape holding these rows (each q tokens), or None."""
        q = len(rows[0].token_ids)
        if kind != "model" or any(len(r.token_ids) != q for r in rows):
            return None
        key = self.shape_for(len(rows), q, max(max(r.start for r in rows) + q, reach or 0))
        if key is None:
            return None
        shape = self._get(key)
        hashes = self._hash_ids(rows)
        shape.batch.fill([self._row(r, shape.batch) for r in rows],
                         {"engram": hashes.numpy()} if hashes is not None else None)
        if self._host_tables:
            for engram, static, ids in zip(self._engram, shape.engram_rows, hashes.unbind(1)):
                static[: ids.shape[0]].copy_(engram.lookup(ids), non_blocking=True)
        return V41StaticStep(self, shape, len(rows), key)

    def _hash_ids(self, rows: list[StepSeq]) -> torch.Tensor | None:
        """Engram hash ids [n·q, n_engram_layers, cols] of the rows, from their host token ids;
        records each row's compressed ids in its sequence's history (as the eager forward does)."""
        hasher = self.model.hasher
        if hasher is None:
            return None
        return torch.cat([hasher.step_ids(r.seq.engram, r.start, torch.tensor(r.token_ids, dtype=torch.long))
                          for r in rows])

    # ---- shapes -------------------------------------------------------------------------------
    def _allocate(self, key: Key) -> Shape:
        kind, size, q, bucket = key
        device, cfg = self.cache.device, self.model.cfg
        if kind == "dspark":  # the tables of the target shape of the same (B, q, C)
            target = self._get(("model", size, q, bucket))
            width = len(cfg.v41.dspark_target_layer_ids) * cfg.hidden_size
            zeros = torch.zeros(size, dtype=torch.long, device=device)
            return _DraftShape(target.batch, inputs=torch.zeros(size * q, width, dtype=self.model.dtype, device=device),
                               accepted=zeros, anchor=zeros.clone())
        extra = None
        if self._engram:
            v = cfg.v41
            extra = {"engram": (size * q, len(self._engram), v.engram_n_hash_cols)}
        batch = DecodeBatch.allocate(self.cache, size, q, bucket // self.cache.layout.block_size, self.sliding_blocks,
                                     extra)
        rows = None
        if self._host_tables:
            head_dim = cfg.v41.engram_head_dim
            rows = [torch.zeros(size * q, cfg.v41.engram_n_hash_cols, head_dim, dtype=torch.bfloat16, device=device)
                    for _ in self._engram]
        return _ModelShape(batch, engram_rows=rows)

    def _capture_keys(self) -> list[Key]:
        keys = super()._capture_keys()  # the 'model' shapes
        return keys + [("dspark", *k[1:]) for k in keys] if self.dspark else keys

    # ---- the programs -------------------------------------------------------------------------
    def _context(self, shape: Shape) -> StepContext:
        model, batch = self.model, shape.batch
        positions = batch.positions
        return StepContext(batch, self.cache, row_groups(batch.num_seqs, batch.tokens_per_seq, positions.device),
                           nx.rotation(positions, model.freqs_main), nx.rotation(positions, model.freqs_compress),
                           model.freqs_compress, getattr(shape, "engram_rows", None) or [])

    def _forward(self, shape: Shape) -> tuple[torch.Tensor, torch.Tensor | None]:
        """'model': (main hidden [B·q, ...] (x when there is no DSpark), logits [B·q, V] fp32);
        'dspark': (drafts [B, block], None)."""
        with nx.numerics(self.model.numerics):
            ctx = self._context(shape)
            if isinstance(shape, _DraftShape):
                observe(self.model, shape.inputs, ctx)
                return draft(self.model, ctx, shape.accepted, shape.anchor), None
            x, main = static_forward(self.model, ctx)
            return (main if main is not None else x), static_logits(self.model, x, x.device)


def build_static_backend(model, cache, config, max_model_len: int, num_drafts: int,
                         sizes: tuple[int, ...] | None = None) -> V41StaticBackend | None:
    """The V4.1 engine's static decode path: on by default on CUDA (captured at start-up unless
    --enforce-eager); on a CPU only when EngineConfig.static_decode asks (see the module docstring). Shapes
    as V4's: --cuda-graph-sizes on CUDA (every size up to max_num_seqs elsewhere, unless `sizes`
    says), q = 1 and 1 + drafts (every depth under adaptive speculation)."""
    cuda = model.device.type == "cuda"
    wanted = config.static_decode if config.static_decode is not None else cuda and not config.enforce_eager
    if not wanted:
        return None
    k = num_drafts
    depths = tuple(range(1, k + 2)) if config.adaptive_speculation else (1, 1 + k)
    if sizes is None:
        sizes = config.cuda_graph_sizes if cuda else tuple(range(1, config.max_num_seqs + 1))
    backend = V41StaticBackend(model, cache, sizes, depths, max_model_len, capture=cuda and not config.enforce_eager,
                               dspark=k > 0)
    backend.capture_all()
    return backend

