"""The dense per-sequence state of the plain V4.1 reference, and the per-forward hand-offs.

`SequenceState` is everything a later forward of the same sequence needs (REF keeps the same
in fixed buffers): each layer's last `window` window-KV rows, each KV source's compressor tail
(ratio 2: < 2 fp32 rows), compressed KV and index keys (one row per group, growing), the
Engram compressed-id history, and each DSpark stage's window of main-model KV.
`ForwardHandoff` is what an index source hands to the layers after it within one forward
(REF's `shared_attn`): the chosen compressed positions and the candidate-block mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SourceState:
    """A KV-source layer's shared cache (read by every layer of its group)."""

    pending_kv: torch.Tensor  # fp32 [n < ratio, D]: tokens of the group still filling
    pending_score: torch.Tensor  # fp32 [n < ratio, D]
    compressed_kv: torch.Tensor  # bf16 [groups, D]: post-RoPE, fake FP4 (e4m3 scale per 16)
    index_keys: torch.Tensor  # bf16 [groups, Di]: post-RoPE, fake FP4 (ue8m0 scale per 32)

    @classmethod
    def empty(cls, head_dim: int, index_head_dim: int) -> "SourceState":
        f32, bf16 = torch.zeros(0, head_dim), torch.zeros(0, head_dim, dtype=torch.bfloat16)
        return cls(f32, f32.clone(), bf16, torch.zeros(0, index_head_dim, dtype=torch.bfloat16))


@dataclass
class SequenceState:
    length: int = 0  # tokens already processed; the next chunk starts at this position
    engram_ids: list[int] = field(default_factory=list)  # compressed id per position
    window_kv: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → bf16 [≤ window, D]
    sources: dict[int, SourceState] = field(default_factory=dict)  # KV-source layer → cache
    dspark_kv: dict[int, torch.Tensor] = field(default_factory=dict)  # stage → bf16 [≤ window, D]
    # `as_shipped` variant only: the index-key owner that published last (REF's shared_attn.index_k)
    last_key_publisher: int | None = None


@dataclass
class IndexTrace:
    """One index source's selection in one forward, for the top-k tests."""

    chosen: torch.Tensor  # int64 [T, k] compressed positions, -1 = none
    scores: torch.Tensor  # bf16 [T, N] the scores it selected from (-inf = not allowed)


@dataclass
class ForwardHandoff:
    topk: torch.Tensor | None = None  # int64 [T, k] from the last index source, -1 = none
    candidates: torch.Tensor | None = None  # bool [T, N] from the candidate source
    published: set[int] = field(default_factory=set)  # owners that published keys this forward
    trace: dict[int, IndexTrace] = field(default_factory=dict)
