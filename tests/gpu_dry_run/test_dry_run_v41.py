"""DeepSeek-V4.1's static decode step on the fake CUDA device (tests/fake_cuda): a release-format
checkpoint on `cuda`, its decode/verify and DSpark programs captured as CUDA graphs, then engine
steps whose target forward and drafting replay them.

The checkpoint is the `tiny` preset cut to four layers and one DSpark stage (fake tensors cost
~0.5 ms per op, and a capture runs a program three times), keeping every V4.1 feature: a ratio-2
and a ratio-1 KV source, a candidate source with a level-two index source after it, Engram on
two layers, DSpark targets, FP8/FP4 weights.

  * engine steps (the kernels' GEMMs, FP8/FP4 KV records, Engram tables in host memory, DSpark
    with k = the block size, a greedy and a sampled request): every decode/verify step after the
    prefill replays the target and the DSpark graphs and reads the host exactly once; the
    captured graphs launch V4.1's Triton GEMMs and the CuPy KV record kernels;
  * the exact (reference, fp64) numerics, the engine's default: both programs capture with no
    host read, sync or host copy inside (any would raise FakeCudaFault).

The fake device fills every host read with 1s, so the steps run on placeholder tokens: this
checks where data and control go (shapes, devices, syncs), never values — the CPU tests against
the golden data do (tests/v41/test_static_decode.py).
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.v41.checkpoint import write_v41_checkpoint
from engine.v41.kv_cache import V41KVCache
from engine.v41.numerics import Numerics
from engine.v41.static_decode import V41StaticBackend
from engine.weights import load_model
from ipc.messages import SamplingParams

FOUR_LAYERS = dict(num_hidden_layers=4, compress_ratios=[0, 2, 1, 1, 0], kv_source_layer_ids=[1, 2],
                   index_source_layer_ids=[1, 2, 3], candidate_source_layer_id=2, engram_layer_ids=[0, 1],
                   dspark_target_layer_ids=[1, 2, 3], num_nextn_predict_layers=1, n_routed_experts=4,
                   dspark_n_routed_experts=2, hc_sinkhorn_iters=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_v41_checkpoint(tmp_path_factory.mktemp("v41-dry") / "four-layers", "tiny", seed=3,
                                quantize="fp8-fp4", **FOUR_LAYERS)


def test_engine_steps_replay_one_read_each(fake_device, checkpoint):
    model = load_model(checkpoint, device="cuda", progress=False, engram_tables="host")
    assert model.layers[0].engram.embed.weight.device.type == "cpu"
    assert not model.numerics.exact  # the kernels' FP8/FP4 GEMMs (Triton on CUDA): the default there
    k = model.cfg.v41.dspark_block_size
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=128, num_kv_blocks=32, block_size=16,
                                        kv_dtype="fp8", speculative_tokens=k, adaptive_speculation=False,
                                        max_model_len=64, cuda_graph_sizes=(2,)))
    assert engine.static is not None  # on CUDA by default, captured at start-up
    assert fake_device.captures == 4  # target and DSpark, q = 1 and 1 + k
    engine.add_request(0, list(range(5, 21)), SamplingParams(max_tokens=40, ignore_eos=True))
    engine.add_request(1, list(range(7, 30)), SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8,
                                                             top_p=0.9, seed=3))
    mark, replays = fake_device.mark(), fake_device.replays
    engine.step()  # the prefill: eager forward (its reads are counted, not faults), drafts from the graph
    assert engine.runner.num_static_steps == 0 and fake_device.replays == replays + 1
    assert len(fake_device.since(mark, "d2h")) > 1
    for _ in range(5):
        mark, replays, static = fake_device.mark(), fake_device.replays, engine.runner.num_static_steps
        engine.step()
        assert engine.runner.num_static_steps == static + 1
        assert fake_device.replays == replays + 2  # the target forward, then DSpark
        reads = fake_device.since(mark, "d2h")
        assert len(reads) == 1 and reads[0].where.startswith("engine/step_sampling.py"), reads
    captured = {launch.kernel.rsplit(":", 1)[1] for launch in fake_device.launches if launch.captured}
    assert {"_quant_gemm_kernel", "_act_quant_kernel"} <= captured, captured
    assert any(name.startswith("scatter_fp4") for name in captured) and any(
        name.startswith("gather_fp4") for name in captured), captured


@torch.inference_mode()
def test_exact_numerics_capture(fake_device, checkpoint):
    """The default numerics (fp64 block products, every expert on every row): one eager run
    outside capture (lazy weight copies), then the capture itself, of a verify shape's target
    and DSpark programs."""
    model = load_model(checkpoint, device="cuda", progress=False)
    assert not model.numerics.exact  # on CUDA the kernels' GEMMs by default; here the reference's, asked for
    model.numerics = Numerics(exact=True)
    q = 1 + model.cfg.v41.dspark_block_size
    cache = V41KVCache.for_model(model, "auto", max_num_seqs=1, num_full_blocks=8, block_size=16)
    backend = V41StaticBackend(model, cache, (1,), (q,), 64, capture=False, dspark=True)
    for kind in ("model", "dspark"):
        shape = backend._get((kind, 1, q, 64))
        backend._forward(shape)
        mark = fake_device.mark()
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            backend._forward(shape)
        assert not fake_device.since(mark)  # nothing crossed between host and device
    assert fake_device.captures == 2
