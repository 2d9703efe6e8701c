"""CUDA-graph capture and replay of decode/verify steps (run on a GPU machine; skipped without one).

Replaying a captured graph runs exactly the kernels of the static-shape forward, so its tokens
must equal the same engine's with capture off, bit for bit, also with FP8/FP4 KV pools (whose
CuPy kernels must then run inside the graph). Against the per-sequence eager path (different
kernels, bf16) the comparison is of logits under teacher forcing: both paths read the same
tokens at every step, so a real disagreement cannot hide behind a diverged continuation.
"""

from __future__ import annotations

import pytest
import torch

from kernels.loader import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and cuda_available()),
                                                  reason="needs a CUDA GPU and CuPy")]

from engine.attention_backend import SequenceBackend, StepSeq  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.cuda_graphs import StaticDecodeBackend  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.weights import load_model  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402

PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)
QUANTIZABLE = dict(head_dim=128, qk_rope_head_dim=64, index_head_dim=64, index_topk=3)


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return load_model(checkpoint_factory("tiny-topk2", index_topk=2), dtype=torch.bfloat16, device="cuda",
                      progress=False)


@pytest.fixture(scope="module")
def quantizable(checkpoint_factory):
    return load_model(checkpoint_factory("tiny-q", **QUANTIZABLE), dtype=torch.bfloat16, device="cuda",
                      progress=False)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (5, 37, 70)]


def _generate(model, static: bool, capture: bool, k: int = 0, kv_dtype: str = "auto"):
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, block_size=16, kv_cache_memory_bytes=16 << 20,
                       cuda_graph_sizes=(1, 2, 4), static_decode=static, enforce_eager=not capture,
                       speculative_tokens=k, max_model_len=512, kv_dtype=kv_dtype)
    engine = Engine(model, cfg)
    for i, prompt in enumerate(_prompts()):
        engine.add_request(i, prompt, PARAMS)
    out: dict[int, list[int]] = {}
    while engine.has_work:
        for d in engine.step().deltas:
            out.setdefault(d.request_id, []).extend(d.token_ids)
    return [out[i] for i in range(3)], engine


@torch.inference_mode()
@pytest.mark.parametrize("k", [0, 3])
def test_graph_replay_equals_the_uncaptured_static_path(model, k):
    replayed, engine = _generate(model, static=True, capture=True, k=k)
    uncaptured, _ = _generate(model, static=True, capture=False, k=k)
    assert engine.static.num_replays > 10
    assert replayed == uncaptured
    assert engine.cache.manager.full.num_used == 0


@torch.inference_mode()
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp4"])
def test_quantized_kv_kernels_replay_inside_graphs(quantizable, kv_dtype):
    """The CuPy quantize/dequantize kernels of FP8/FP4 pools are captured with the step: replay
    gives the uncaptured tokens bit for bit."""
    replayed, engine = _generate(quantizable, static=True, capture=True, kv_dtype=kv_dtype)
    uncaptured, _ = _generate(quantizable, static=True, capture=False, kv_dtype=kv_dtype)
    assert engine.static.num_replays > 10
    assert replayed == uncaptured


@torch.inference_mode()
def test_graph_replay_logits_match_the_eager_path_under_teacher_forcing(model):
    """Prefill three sequences in two caches, then feed both the same 24 tokens per sequence:
    replayed graphs (static backend) vs the per-sequence eager path, logits compared each step."""
    prompts = _prompts()
    caches = [KVCache.for_model(model, "auto", max_num_seqs=4, num_full_blocks=64, block_size=16) for _ in range(2)]
    graphs = StaticDecodeBackend(model, caches[0], (4,), (1,), 512, capture=True)
    graphs.capture_all()
    eager = SequenceBackend(model.device)
    seqs = [[c.new_sequence() for _ in prompts] for c in caches]
    for cache, row in zip(caches, seqs):
        for seq, p in zip(row, prompts):
            assert cache.allocate(seq, 0, len(p) + 32)
        eager.prepare([StepSeq(s, 0, p) for s, p in zip(row, prompts)]).run(model, None)
    gen = torch.Generator().manual_seed(1)
    forced = torch.randint(2, 500, (24, len(prompts)), generator=gen).tolist()
    worst, agree = 0.0, 0
    for t, tokens in enumerate(forced):
        rows = [[StepSeq(s, len(p) + t, [tok]) for s, p, tok in zip(row, prompts, tokens)] for row in seqs]
        _, got = graphs.prepare(rows[0]).run(model, list(range(len(prompts))))
        _, want = eager.prepare(rows[1]).run(model, list(range(len(prompts))))
        scale = want.abs().amax(dim=-1, keepdim=True)
        worst = max(worst, ((got - want).abs() / scale).max().item())
        agree += (got.argmax(-1) == want.argmax(-1)).sum().item()
    assert graphs.num_replays == len(forced)
    assert worst < 0.05, f"largest logit difference {worst:.3f} of the row's scale"  # bf16, different kernels
    assert agree >= 0.95 * len(forced) * len(prompts)


@torch.inference_mode()
def test_graph_replay_agrees_with_the_per_sequence_path(model):
    replayed, _ = _generate(model, static=True, capture=True)
    eager, _ = _generate(model, static=False, capture=False)
    same = sum(a == b for r, e in zip(replayed, eager) for a, b in zip(r, e))
    assert same >= 0.9 * sum(len(e) for e in eager)
