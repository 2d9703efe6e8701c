"""DeepSeek-V4.1 vision under expert parallelism (vLLM's data-parallel encoder mode: the ViT is
replicated on every rank, only the backbone's routed experts are split):
  * every rank's partial load holds the whole tower, the span vectors and every gate's `bias_vl`,
    equal to a whole load's;
  * one backbone MoE layer through the expert-parallel dispatch (a one-rank gloo group) with an
    image mask routes image rows with `bias_vl` exactly as the one-rank MoE does, bit for bit,
    and the mask matters (without it the output differs);
  * through real worker processes (two DP ranks; two EP ranks, gloo, lockstep), requests with
    images give the one-rank tokens.
"""

from __future__ import annotations

import asyncio
import inspect

import numpy as np
import pytest
import torch
import torch.distributed as dist

from engine.config import EngineConfig, ModelConfig, ParallelConfig
from engine.distributed import eplb
from engine.distributed.all2all import SlotLayout
from engine.distributed.expert_parallel import _backend, experts_to_load, initial_placement
from engine.distributed.group import pick_free_port
from engine.v41.checkpoint import write_v41_checkpoint
from engine.v41.expert_parallel import V41ExpertParallelMoE
from engine.v41.vision.frontend import VisionFrontend
from engine.v41.weights import load_v41
from ipc.loop import new_event_loop
from ipc.messages import Finished, SamplingParams
from tests.v41.test_vision_engine import png


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_v41_checkpoint(tmp_path_factory.mktemp("v41epv") / "tiny", "tiny", seed=8, quantize="fp8-fp4",
                                vision=True)


def test_every_rank_holds_the_whole_tower(model_dir):
    cfg = ModelConfig.from_model_dir(model_dir)
    whole = load_v41(model_dir, load_mtp=False)
    tower = dict(whole.encoder.state_dict())
    placement = initial_placement(cfg, 0, ParallelConfig(data_parallel_size=2, enable_expert_parallel=True))
    for rank in range(2):
        part = load_v41(model_dir, load_mtp=False, experts=experts_to_load(placement, rank))
        got = part.encoder.state_dict()
        assert got.keys() == tower.keys() and all(torch.equal(got[k], tower[k]) for k in tower)
        for mine, full in zip(part.layers, whole.layers):
            assert torch.equal(mine.ffn.gate.bias_vl, full.ffn.gate.bias_vl)


@pytest.fixture(scope="module")
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pick_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dispatch_routes_image_rows_with_bias_vl(model_dir, one_rank_group):
    layer, redundant = 1, 2
    whole = load_v41(model_dir, load_mtp=False)
    cfg = whole.cfg
    load = np.arange(1, cfg.n_routed_experts + 1, dtype=np.float64)[None] ** 3
    placement = eplb.rebalance(load, 1, redundant)
    part = load_v41(model_dir, load_mtp=False, experts={layer: placement.local_experts(0, 0).tolist()})
    a2a = _backend("all_to_all", SlotLayout(placement.num_physical, 1), None, capacity=64 * cfg.num_experts_per_tok)
    moe = part.layers[layer].ffn
    moe.parallel = V41ExpertParallelMoE(a2a, moe.experts, *placement.layer_maps(0))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, cfg.hidden_size, generator=g).to(torch.bfloat16)  # [T, dim]
    mask = torch.zeros(40, dtype=torch.bool)
    mask[5:30] = True  # an image span across the chunk borders
    bounds = [(0, 13), (13, 14), (14, 40)]
    want = torch.cat([whole.layers[layer].ffn(x[a:b], mask[a:b]) for a, b in bounds])

    def per_chunk(fn, *t):
        parts = [fn(*(v[a:b] for v in t)) for a, b in bounds]
        return tuple(torch.cat(p) for p in zip(*parts)) if isinstance(parts[0], tuple) else torch.cat(parts)

    assert torch.equal(moe.forward_parallel(x, per_chunk, mask), want)
    assert not torch.equal(moe.forward_parallel(x, per_chunk), want)


def _run(model_dir, parallel: ParallelConfig, requests) -> list[list[int]]:
    from server.engine_client import EngineClient

    async def main():
        config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory_bytes=16 << 20,
                              block_size=16, max_model_len=256, cpu_matmul_precision="fp32")
        client = EngineClient(model_dir, config, threads_per_worker=1, parallel=parallel, image_bytes=1 << 20)
        await client.start()
        try:
            async def one(ids, images):
                tokens = []
                async for item in client.generate(ids, SamplingParams(max_tokens=6, ignore_eos=True), images=images):
                    assert not isinstance(item, Finished) or item.error is None, item
                    if not isinstance(item, Finished):
                        tokens += item.token_ids
                return tokens

            return await asyncio.wait_for(asyncio.gather(*(one(*r) for r in requests)), timeout=300)
        finally:
            await client.shutdown()

    loop = new_event_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def test_dp2_and_ep2_with_images_equal_one_rank(model_dir):
    """Four requests with images over two data-parallel ranks (each a whole model, tower
    included), then two expert-parallel ranks (lockstep): the one-rank tokens."""
    from server.engine_client import EngineClient

    if "images" not in inspect.signature(EngineClient.generate).parameters:
        pytest.skip("server/engine_client.py does not pass images to the workers yet")
    fe = VisionFrontend.from_model_dir(model_dir)
    rng = np.random.default_rng(2)
    requests = []
    for i, size in enumerate(((64, 48), (30, 90), (64, 48), (40, 40))):
        image = fe.preprocess(png(*size, 20 + i))
        ids, starts = fe.expand_placeholders(rng.integers(3, 500, 6).tolist() + [fe.image_token_id] +
                                             rng.integers(3, 500, 9).tolist(), [image])
        requests.append((ids, fe.image_data([image], starts)))
    single = _run(model_dir, ParallelConfig(), requests)
    assert _run(model_dir, ParallelConfig(data_parallel_size=2), requests) == single
    assert _run(model_dir, ParallelConfig(data_parallel_size=2, enable_expert_parallel=True), requests) == single
