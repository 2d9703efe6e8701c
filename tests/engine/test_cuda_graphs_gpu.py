"""CUDA-graph capture and replay of decode/verify steps (run on a GPU machine; skipped without one).

Replaying a captured graph runs exactly the kernels of the static-shape forward, so its tokens
must equal the same engine's with capture off, bit for bit; against the per-sequence eager
path (different kernels, bf16) the greedy tokens must agree but for rare near-ties.
"""

from __future__ import annotations

import pytest
import torch

from kernels.loader import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and cuda_available()),
                                                  reason="needs a CUDA GPU and CuPy")]

from engine.engine import Engine, EngineConfig  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.weights import load_model  # noqa: E402

PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return load_model(checkpoint_factory("tiny-topk2", index_topk=2), dtype=torch.bfloat16, device="cuda",
                      progress=False)


def _generate(model, static: bool, capture: bool, k: int = 0) -> tuple[list[list[int]], Engine]:
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, block_size=16, kv_cache_memory_bytes=16 << 20,
                       cuda_graph_sizes=(1, 2, 4), static_decode=static, enforce_eager=not capture,
                       speculative_tokens=k, max_model_len=512)
    engine = Engine(model, cfg)
    gen = torch.Generator().manual_seed(0)
    for i, n in enumerate((5, 37, 70)):
        engine.add_request(str(i), torch.randint(2, 500, (n,), generator=gen).tolist(), PARAMS)
    out: dict[str, list[int]] = {}
    while engine.has_work:
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    return [out[str(i)] for i in range(3)], engine


@torch.inference_mode()
@pytest.mark.parametrize("k", [0, 3])
def test_graph_replay_equals_the_uncaptured_static_path(model, k):
    replayed, engine = _generate(model, static=True, capture=True, k=k)
    uncaptured, _ = _generate(model, static=True, capture=False, k=k)
    assert engine.graphs.num_replays > 10
    assert replayed == uncaptured
    assert engine.cache.manager.full.num_used == 0


@torch.inference_mode()
def test_graph_replay_agrees_with_the_per_sequence_path(model):
    replayed, _ = _generate(model, static=True, capture=True)
    eager, _ = _generate(model, static=False, capture=False)
    same = sum(a == b for r, e in zip(replayed, eager) for a, b in zip(r, e))
    assert same >= 0.9 * sum(len(e) for e in eager)
