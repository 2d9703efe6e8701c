"""The fused decode step compiled on a GPU (skipped without one; scripts/gpu_check.sh runs it).

On CPU the fused kernels are checked under Triton's interpreter (tests/kernels/); here the same
forward runs compiled for the device: its logits must match the torch static path's on the same
pool contents (fp32 model: both paths are fp32 maths, so a gap past 1e-3 is a kernel bug, not
rounding), and a static decode step, speculation included, must make exactly one host sync, as
torch.cuda.set_sync_debug_mode reports them.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from engine.attention_backend import StepSeq  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.cuda_graphs import StaticDecodeBackend  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.v4.attention import SeqSlice, SequenceContext  # noqa: E402
from engine.weights import load_model  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402

QUANTIZABLE = dict(head_dim=128, qk_rope_head_dim=64, index_head_dim=64, index_topk=3)


@pytest.fixture(scope="module")
def models(checkpoint_factory):
    return {"auto": load_model(checkpoint_factory("tiny-topk2", index_topk=2), dtype=torch.float32, device="cuda",
                               progress=False),
            "fp8": load_model(checkpoint_factory("tiny-q", **QUANTIZABLE), dtype=torch.float32, device="cuda",
                              progress=False)}


def _prefilled(model, kv_dtype: str, q: int, prompts=(3, 21, 38, 70)):
    cache = KVCache.for_model(model, kv_dtype, max_num_seqs=4, num_full_blocks=48, block_size=16)
    rows = []
    for i, n in enumerate(prompts):
        seq = cache.new_sequence()
        assert cache.allocate(seq, 0, n + q)
        prompt = torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(i)).cuda()
        model(prompt, torch.arange(n, device="cuda"), SequenceContext([SeqSlice(seq, 0, 0, n)]))
        rows.append(StepSeq(seq, n, [7 + j for j in range(q)]))
    return cache, rows


@pytest.mark.parametrize("kv_dtype,q", [("auto", 1), ("auto", 3), ("fp8", 1)])
@torch.inference_mode()
def test_compiled_fused_step_equals_the_static_torch_path(models, kv_dtype, q):
    model = models[kv_dtype]
    cache, rows = _prefilled(model, kv_dtype, q)
    pools = [t for p in cache.pools.values() for t in p.tensors.values()]
    saved = [t.clone() for t in pools]
    logits = {}
    for fused in (False, True):
        for t, s in zip(pools, saved):
            t.copy_(s)
        backend = StaticDecodeBackend(model, cache, (4,), (q,), 256, capture=False, fused=fused)
        _, out = backend.prepare(rows).run(model, None)
        logits[fused] = out[: len(rows) * q].clone()
    assert torch.isfinite(logits[True]).all()
    assert (logits[True] - logits[False]).abs().max().item() < 1e-3
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))


@pytest.mark.parametrize("k", [0, 2])
@torch.inference_mode()
def test_one_host_sync_per_captured_decode_step(models, k):
    """Every runner step on captured static shapes (drafts and MTP steps included): one sync."""
    model = models["auto"]
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
                                        kv_cache_memory_bytes=16 << 20, cuda_graph_sizes=(1, 2, 4),
                                        static_decode=True, speculative_tokens=k, adaptive_speculation=False,
                                        max_model_len=256))
    for i, p in enumerate([SamplingParams(max_tokens=10, ignore_eos=True),
                           SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3)]):
        engine.add_request(i, [5 + i, 9, 17, 33, 40], p)
    runner, syncs = engine.runner, []
    execute = runner.execute

    def counted(batch, *args, **kwargs):
        static = runner.static_ok(batch)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = execute(batch, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append((static, [str(w.message)[:120] for w in seen if "synchroniz" in str(w.message)]))
        return out

    runner.execute = counted
    while engine.has_work:
        engine.step()
    decode = [s for static, s in syncs if static]
    assert len(decode) >= 3
    assert all(len(s) == 1 for s in decode), decode


@pytest.mark.parametrize("k", [0, 2])
@torch.inference_mode()
def test_async_launches_make_no_host_sync(models, k):
    """--async-scheduling on captured shapes, with and without MTP: launching a decode or verify
    step while its predecessor is in flight makes no host sync (placeholders, drafts and
    position shifts come from the predecessor's device results), and the greedy requests'
    tokens equal the synchronous engine's."""
    model = models["auto"]
    params = [SamplingParams(max_tokens=14, ignore_eos=True), SamplingParams(max_tokens=11, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3)]

    def engine(async_scheduling: bool) -> Engine:
        return Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
                                          kv_cache_memory_bytes=16 << 20, cuda_graph_sizes=(1, 2, 4),
                                          static_decode=True, speculative_tokens=k, adaptive_speculation=False,
                                          max_model_len=256, async_scheduling=async_scheduling))

    def drive(e: Engine) -> dict[int, list[int]]:
        for i, p in enumerate(params):
            e.add_request(i, [5 + i, 9, 17, 33, 40], p)
        out = {i: [] for i in range(len(params))}
        while e.has_work:
            for d in e.step().deltas:
                out[d.request_id] += d.token_ids
        return out

    want = drive(engine(False))
    e = engine(True)
    assert e.async_scheduling
    runner, syncs = e.runner, []
    launch = runner.launch

    def counted(batch, *args, ahead=None, **kwargs):
        if ahead is None or batch.uniform_decode is None:
            return launch(batch, *args, ahead=ahead, **kwargs)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = launch(batch, *args, ahead=ahead, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append([str(w.message)[:120] for w in seen if "synchroniz" in str(w.message)])
        return out

    runner.launch = counted
    got = drive(e)
    assert got[0] == want[0] and got[1] == want[1]
    assert len(syncs) >= 3 and all(not s for s in syncs), syncs
