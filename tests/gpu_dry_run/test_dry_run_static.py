"""V4's static decode backend on the fake CUDA device: CUDA-graph capture and replay of decode
and verify shapes for every KV record format, fused (Triton) and unfused (torch) forwards, fp32
and bf16 models, dense and FP8/FP4 weights.

Each case prefills four sequences eagerly, then prepares and runs a captured shape twice: the
capture itself must make no host read, sync or host copy (a fault raises), each run replays
the graph, and the host side of a step is one table fill (one host-to-device copy) and no
device read — the step's results stay on the device for the sampler.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention_backend import StepSeq
from engine.cuda_graphs import StaticDecodeBackend
from engine.kv_cache import KVCache
from engine.v4.attention import SeqSlice, SequenceContext
from engine.weights import load_model

# The released head geometry the quantized KV records need (scaled down elsewhere); one layer of
# each attention kind (window only, compressed sparse, heavily compressed) and each MoE kind.
GEOMETRY = dict(head_dim=128, qk_rope_head_dim=64, index_head_dim=64, index_topk=3, num_hidden_layers=3,
                layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                mlp_layer_types=["hash_moe", "moe", "moe"])
CASES = [  # (weights, model dtype, kv dtype, fused, q)
    ("dense", torch.bfloat16, "auto", True, 1), ("dense", torch.bfloat16, "auto", False, 3),
    ("dense", torch.bfloat16, "fp8", True, 3), ("dense", torch.bfloat16, "fp4", False, 1),
    ("dense", torch.float32, "auto", True, 3), ("dense", torch.float32, "fp8", False, 1),
    ("dense", torch.float32, "fp4", True, 1), ("dense", torch.float32, "auto", False, 1),
    ("fp8-fp4", torch.bfloat16, "fp8", True, 1), ("fp8-fp4", torch.bfloat16, "fp4", True, 3),
    ("fp8-fp4", torch.float32, "auto", False, 3), ("fp8-fp4", torch.float32, "fp4", False, 1),
]


@pytest.fixture(scope="module")
def checkpoints(checkpoint_factory):
    return {"dense": checkpoint_factory("dry-dense", **GEOMETRY),
            "fp8-fp4": checkpoint_factory("dry-quant", quantize="fp8-fp4", **GEOMETRY)}


def _prefilled(model, kv_dtype: str, q: int, prompts=(5, 37)):
    """Two sequences prefilled in one eager forward (the batch-4 shape then has padding rows)."""
    cache = KVCache.for_model(model, kv_dtype, max_num_seqs=4, num_full_blocks=48, block_size=16)
    rows, slices, begin = [], [], 0
    for n in prompts:
        seq = cache.new_sequence()
        assert cache.allocate(seq, 0, n + q)
        slices.append(SeqSlice(seq, 0, begin, n))
        rows.append(StepSeq(seq, n, [7 + j for j in range(q)]))
        begin += n
    tokens = torch.cat([torch.arange(2, 2 + n) for n in prompts]).cuda()
    positions = torch.cat([torch.arange(n) for n in prompts]).cuda()
    model(tokens, positions, SequenceContext(slices))
    return cache, rows


@pytest.mark.parametrize("weights,dtype,kv_dtype,fused,q", CASES,
                         ids=[f"{w}-{str(d)[6:]}-{k}-{'fused' if f else 'torch'}-q{q}" for w, d, k, f, q in CASES])
@torch.inference_mode()
def test_static_shapes_capture_and_replay(fake_device, checkpoints, weights, dtype, kv_dtype, fused, q):
    model = load_model(checkpoints[weights], dtype=dtype, device="cuda", progress=False)
    cache, rows = _prefilled(model, kv_dtype, q)
    backend = StaticDecodeBackend(model, cache, (4,), (q,), 256, capture=True, fused=fused)
    for _ in range(2):
        mark, replays = fake_device.mark(), fake_device.replays
        streams, logits = backend.prepare(rows).run(model, None)
        assert fake_device.replays == replays + 1 and backend.num_replays == backend.num_runs
        step = fake_device.since(mark)
        assert [t.kind for t in step] == ["h2d"], step  # the tables' one copy; no read, no wait
        assert logits.shape == (len(rows) * q, model.cfg.vocab_size) and logits.device.type == "cuda"
    assert fake_device.captures == 1
    captured = [launch for launch in fake_device.launches if launch.captured]
    if fused:  # the fused forward is Triton (and the CuPy routing/KV kernels) end to end
        kernels = {launch.kernel.rsplit(":", 1)[1] for launch in captured}
        assert {"_sparse_mla_decode_kernel", "_scores_kernel", "_topk_kernel", "_norm_rope_kernel", "_mhc_mix_kernel",
                "_compressor_step_kernel"} <= kernels, kernels
