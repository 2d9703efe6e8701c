"""DeepSeek-V4.1 under expert parallelism (engine/v41/expert_parallel.py).

Through real worker processes (a gloo group, lockstep steps, dummy forwards on an idle rank):
EP over 2 ranks with DSpark on gives DeepSeek's greedy tokens for every golden prompt of c1,
and on a `make-model --arch v41 --preset tiny --quantize fp8-fp4` checkpoint (with redundant
experts) the same tokens as one rank, requests arriving at random moments, over 2 and over 4
ranks. Each rank holds its share of the backbone's routed experts (2 and 4 ranks) and every
DSpark stage whole. In-process: the row packing carries the routing weight bit for bit, and
the combine's sum follows the one-rank MoE's ascending-expert order, and one MoE layer through
every all-to-all backend (a one-rank gloo group, redundant replicas) equals the whole layer bit
for bit.
"""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from engine.config import ModelConfig, ParallelConfig
from engine.distributed import eplb
from engine.distributed.all2all import SlotLayout
from engine.distributed.expert_parallel import _backend, experts_to_load, initial_placement
from engine.distributed.group import pick_free_port
from engine.v41.checkpoint import write_v41_checkpoint
from engine.v41.expert_parallel import V41ExpertParallelMoE, ascending_sum, pack_rows, unpack_rows
from engine.v41.weights import load_v41
from ipc.loop import new_event_loop
from ipc.messages import Finished, SamplingParams
from server.engine_client import EngineClient
from server.llm import LLM

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=512, kv_cache_memory_bytes=64 * 2**20, block_size=16,
              max_model_len=512)


def ep(ranks: int, redundant: int = 0) -> ParallelConfig:
    return ParallelConfig(data_parallel_size=ranks, enable_expert_parallel=True, num_redundant_experts=redundant)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_v41_checkpoint(tmp_path_factory.mktemp("v41ep") / "tiny", "tiny", seed=7, quantize="fp8-fp4")


# ---- in-process: packing and summation order ------------------------------------------------------


def test_packed_rows_carry_hidden_state_and_weight_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=g).to(torch.bfloat16)
    w = torch.rand(5, 3, generator=g)
    w[0, 0], w[1, 2] = 1e-30, 3.4e38  # a subnormal-ish tiny and a huge weight survive too
    rows = pack_rows(x, w)
    assert rows.shape == (15, 18) and rows.dtype == torch.bfloat16
    got_x, got_w = unpack_rows(rows)
    assert torch.equal(got_x, x.repeat_interleave(3, dim=0))
    assert torch.equal(got_w[:, 0], w.reshape(-1))


def test_choices_sum_in_ascending_expert_order_as_the_one_rank_moe():
    """The one-rank MoE adds expert outputs to an fp32 zero in ascending expert order; fp32
    addition is not associative, so the order is visible in the bits (values of mixed scale)."""
    g = torch.Generator().manual_seed(1)
    t, k, h = 64, 4, 8
    ids = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(t)])  # [T, k] distinct per token
    scale = torch.tensor([1e4, 1.0, 1e-3, 3.0])[torch.randint(0, 4, (t, k, 1), generator=g)]
    per_choice = (torch.randn(t, k, h, generator=g) * scale).to(torch.bfloat16)
    want = torch.zeros(t, h)
    for e in torch.unique(ids).tolist():  # the one-rank loop of engine/v41/moe.py
        tokens, choice = torch.where(ids == e)
        want[tokens] += per_choice[tokens, choice]
    assert torch.equal(ascending_sum(per_choice, ids), want)
    in_choice_order = per_choice.float().sum(dim=1)
    assert not torch.equal(in_choice_order, want)  # the order matters for these values


def test_each_rank_holds_its_share_of_the_backbone_experts(tiny):
    cfg = ModelConfig.from_model_dir(tiny)
    whole = load_v41(tiny)

    def expert_bytes(moes) -> int:
        return sum(t.numel() * t.element_size() for m in moes for t in m.experts.state_dict().values())

    backbone = lambda model: [b.ffn for b in model.layers]  # noqa: E731
    stages = lambda model: [s.ffn for s in model.mtp]  # noqa: E731
    assert len(whole.mtp) == cfg.num_nextn_predict_layers
    for ranks, redundant in ((2, 0), (2, 2), (4, 0), (4, 4)):
        placement = initial_placement(cfg, len(whole.mtp), ep(ranks, redundant))
        assert placement.num_layers == cfg.num_layers  # the DSpark stages are not placed
        for rank in range(ranks):
            part = load_v41(tiny, experts=experts_to_load(placement, rank))
            share = (cfg.n_routed_experts + redundant) / ranks / cfg.n_routed_experts
            assert expert_bytes(backbone(part)) == expert_bytes(backbone(whole)) * share
            assert expert_bytes(stages(part)) == expert_bytes(stages(whole))  # replicated
            for layer in range(cfg.num_layers):
                held, full = part.layers[layer].ffn.experts, whole.layers[layer].ffn.experts
                assert list(held.logical_ids) == placement.local_experts(layer, rank).tolist()
                for slot, e in enumerate(held.logical_ids):
                    for name in ("w13", "w2"):
                        assert torch.equal(getattr(held, name).weight[slot], getattr(full, name).weight[e])
                        assert torch.equal(getattr(held, name).scale[slot], getattr(full, name).scale[e])


@pytest.fixture(scope="module")
def one_rank_group():
    """A world-size-1 gloo group in this process: every backend's code path, no peers."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pick_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["all_to_all", "padded_all_to_all", "allgather_reducescatter"])
def test_dispatch_equals_the_one_rank_moe_on_every_backend(tiny, one_rank_group, backend):
    """One backbone MoE layer over three chunks: whole, then through V41ExpertParallelMoE on a
    placement with redundant replicas of the heaviest experts (consecutive tokens take different
    replicas); the outputs are equal bit for bit, and a zero-row call (the idle forward) works."""
    layer, redundant = 1, 4
    whole = load_v41(tiny, load_mtp=False)
    cfg = whole.cfg
    load = np.arange(1, cfg.n_routed_experts + 1, dtype=np.float64)[None] ** 3  # [1, E] skewed
    placement = eplb.rebalance(load, 1, redundant)
    assert placement.logical_replica_count.max() > 1
    part = load_v41(tiny, load_mtp=False, experts={layer: placement.local_experts(0, 0).tolist()})
    a2a = _backend(backend, SlotLayout(placement.num_physical, 1), None, capacity=64 * cfg.num_experts_per_tok)
    moe = part.layers[layer].ffn
    moe.parallel = V41ExpertParallelMoE(a2a, moe.experts, *placement.layer_maps(0))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, cfg.hidden_size, generator=g).to(torch.bfloat16)  # [T, dim]
    bounds = [(0, 13), (13, 14), (14, 40)]
    want = torch.cat([whole.layers[layer].ffn(x[a:b]) for a, b in bounds])

    def per_chunk(fn, *t):
        parts = [fn(*(v[a:b] for v in t)) for a, b in bounds]
        return tuple(torch.cat(p) for p in zip(*parts)) if isinstance(parts[0], tuple) else torch.cat(parts)

    assert torch.equal(moe.forward_parallel(x, per_chunk), want)
    k = cfg.num_experts_per_tok
    idle = moe.parallel(x[:0], torch.zeros(0, k), torch.zeros(0, k, dtype=torch.long))
    assert idle.shape == (0, cfg.hidden_size)


# ---- real processes -------------------------------------------------------------------------------


def test_ep2_with_dspark_gives_the_golden_tokens(golden_root):
    """Three prompts of 20, 121 and 300 tokens over two ranks: the rank with less work idles
    (dummy forwards) while the other finishes."""
    d = golden_root / "c1"
    g = json.loads((d / "golden.json").read_text())
    k = json.loads((d / "config.json").read_text())["text_config"]["dspark_block_size"]
    params = SamplingParams(max_tokens=g["max_new_tokens"], ignore_eos=True)
    with LLM(d, threads_per_worker=1, parallel=ep(2), speculative_tokens=k, adaptive_speculation=False,
             **ENGINE) as llm:
        outs = llm.generate(g["prompts"], params)
    assert [o.error for o in outs] == [None] * len(outs)
    assert [o.token_ids for o in outs] == g["tokens"]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def _run(model_dir, parallel: ParallelConfig, prompts, session: str | None = None):
    """Every prompt through the client at a random moment: (greedy tokens per prompt, each rank's
    last heartbeat)."""
    async def main():
        client = EngineClient(model_dir, _config(), threads_per_worker=1, parallel=parallel)
        await client.start()
        try:
            rng = random.Random(1)

            async def one(ids):
                await asyncio.sleep(rng.random() * 0.5)
                tokens = []
                async for item in client.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True), session=session):
                    if not isinstance(item, Finished):
                        tokens += item.token_ids
                return tokens

            got = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=300)
            # Heartbeats (every 0.25 s) are not in step across ranks: let the idle group's settle.
            deadline = asyncio.get_running_loop().time() + 10.0
            while (len({r.last_beat.step for r in client.ranks}) > 1
                   and asyncio.get_running_loop().time() < deadline):
                await asyncio.sleep(0.1)
            return got, [r.last_beat for r in client.ranks]
        finally:
            await client.shutdown()

    loop = new_event_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def _config():
    from engine.config import EngineConfig

    return EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory_bytes=16 << 20, block_size=16,
                        max_model_len=256, cpu_matmul_precision="fp32")  # exact: compared with golden tokens


@pytest.fixture(scope="module")
def single(tiny):
    prompts = _prompts(5)
    return prompts, _run(tiny, ParallelConfig(), prompts)[0]


def test_ep2_equals_one_rank_across_live_rebalances(tiny, single):
    """Mixed prompts at random steps (chunked prefill: 32 tokens a step), 2 redundant experts,
    EPLB every 4 steps moving expert weights between the ranks while requests are in flight."""
    prompts, expected = single
    parallel = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=2,
                              enable_eplb=True, eplb_step_interval=4)
    got, beats = _run(tiny, parallel, prompts)
    assert got == expected
    assert all(b.eplb_rebalances >= 2 for b in beats), beats


def test_ep2_with_every_request_on_one_rank(tiny, single):
    """Session affinity pins every request to rank 0: rank 1 runs only dummy forwards (zero rows
    through every backbone MoE dispatch), or rank 0 would wait in a collective forever."""
    prompts, expected = single
    got, beats = _run(tiny, ep(2), prompts, session="everything-here")
    assert got == expected
    assert beats[0].step == beats[1].step > 0  # lockstep: the idle rank stepped as often


def test_ep4_equals_one_rank(tiny, single):
    """Four ranks, 4 redundant experts (3 slots each of 8 experts + 4 replicas): the mixed prompts
    at random steps give the one-rank tokens; every rank stepped in lockstep and reports an
    expert load for each backbone MoE layer (its dispatch ran). Each rank's share of the expert
    bytes at 4 ranks: test_each_rank_holds_its_share_of_the_backbone_experts."""
    prompts, expected = single
    got, beats = _run(tiny, ep(4, redundant=4), prompts)
    assert got == expected
    assert len(beats) == 4 and len({b.step for b in beats}) == 1 and beats[0].step > 0
    layers = ModelConfig.from_model_dir(tiny).num_layers
    assert all(len(b.expert_imbalance) == layers for b in beats), beats
