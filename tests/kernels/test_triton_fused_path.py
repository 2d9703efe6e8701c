"""The fused kernels composed into a decode step (perf/fused_decode.py) equal the engine's static path.

Decode (q = 1) and verify-shaped (q = 2) steps of a tiny random model, run once through
`StaticDecodeBackend` (today's torch static path) and once through `fused_forward` on an identical copy
of the KV pools: the output streams and every pool block a live sequence owns must agree. The
index top-k is below the entry count, so CSA layers take the sparse (indexer) branch. Under
--kv-dtype fp4 (fp8_ds_mla window, fp4_kv entries, fp4_index keys) the two paths' activations
differ by float rounding (~1e-6), which may flip a rare quantization code.
"""
from __future__ import annotations

import pytest
import torch

from engine.attention_backend import StepSeq
from engine.cuda_graphs import StaticDecodeBackend
from engine.decode_batch import DecodeBatch
from engine.kv_cache import KVCache
from engine.v4.attention import SeqSlice, SequenceContext
from engine.weights import load_model
from perf.fused_decode import fused_forward

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

PROMPTS = (3, 21, 38)  # before / across the window (8) and several compress boundaries (4, 8)


QUANTIZABLE = dict(head_dim=128, qk_rope_head_dim=64, index_head_dim=64, index_topk=3)


@pytest.fixture(scope="module")
def models(checkpoint_factory):
    return {"auto": load_model(checkpoint_factory("tiny-topk2", index_topk=2), dtype=torch.float32, progress=False),
            "fp4": load_model(checkpoint_factory("tiny-q", **QUANTIZABLE), dtype=torch.float32, progress=False)}


def _prefilled(model, kv_dtype: str, q: int):
    cache = KVCache.for_model(model, kv_dtype, max_num_seqs=4, num_full_blocks=32, block_size=16)
    rows = []
    for i, n in enumerate(PROMPTS):
        seq = cache.new_sequence()
        assert cache.allocate(seq, 0, n + q)
        prompt = torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(i))
        model(prompt, torch.arange(n), SequenceContext([SeqSlice(seq, 0, 0, n)]))
        rows.append(StepSeq(seq, n, [7 + j for j in range(q)]))
    return cache, rows


def _pools(cache: KVCache) -> dict:
    return {(name, layer): t.clone() for name, pool in cache.pools.items() for layer, t in pool.tensors.items()}


def _restore(cache: KVCache, saved: dict) -> None:
    for (name, layer), t in saved.items():
        cache.pools[name].tensors[layer].copy_(t)


@pytest.mark.parametrize("kv_dtype,q", [("auto", 1), ("fp4", 1)])  # auto q = 2: the bench test below
@torch.inference_mode()
def test_fused_step_equals_the_static_path(models, kv_dtype, q):
    model = models[kv_dtype]
    cache, rows = _prefilled(model, kv_dtype, q)
    before = _pools(cache)
    graphs = StaticDecodeBackend(model, cache, (4,), (q,), 256, capture=False)
    key = graphs.shape_for(len(rows), q, max(r.start + q for r in rows))
    streams, _ = graphs.prepare(rows).run(model, None)
    static = streams.clone()
    after_static = _pools(cache)

    _restore(cache, before)
    _, size, _, bucket = key
    batch = DecodeBatch.allocate(cache, size, q, bucket // cache.layout.block_size, graphs.sliding_blocks)
    batch.fill([graphs._row(r, batch) for r in rows])
    fused = fused_forward(model, batch)[: len(rows) * q]
    assert torch.isfinite(fused).all()
    assert (fused - static).abs().max().item() < 1e-4

    owned = {"full": set(), "sliding": set()}
    for r in rows:
        owned["full"].update(r.seq.table.full)
        owned["sliding"].update(r.seq.table.sliding)
    after_fused = _pools(cache)
    for (name, layer), t in after_fused.items():
        ids = sorted(owned[cache.pools[name].spec.group])
        ours, theirs = t[ids], after_static[(name, layer)][ids]
        if t.dtype == torch.uint8:  # records: at most a rare code flip
            assert (ours != theirs).float().mean().item() < 1e-3, (name, layer)
        else:
            # equal_nan: pools start uninitialised, and untouched garbage is the same in both runs.
            assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4, equal_nan=True), (name, layer)


def test_bench_counts_one_launch_per_fused_kernel(models):
    """perf/bench_gpu_ops.py on a q = 2 (verify-shaped) step of the engine's two static forwards:
    the same logits; each mHC site is one launch on the fused path (hundreds on the static one);
    at most 40 launches per layer; KV reads no more than the records the step needs; no host sync."""
    from perf.bench_gpu_ops import measure, needed_kv

    model = models["auto"]
    cache, rows = _prefilled(model, "auto", 2)
    counts, logits = measure(model, cache, rows, 2)
    assert torch.isfinite(logits["fused"]).all()
    assert (logits["fused"] - logits["static"]).abs().max().item() < 1e-4
    static, fused = counts["static"], counts["fused"]
    iters = model.cfg.hc_sinkhorn_iters
    for layer, kind in enumerate(model.cfg.layer_kinds):
        assert fused.launches[layer]["mHC mix"] == 2
        assert static.launches[layer]["mHC mix"] > 2 * 2 * iters          # two divisions per Sinkhorn round
        assert sum(fused.launches[layer].values()) <= 40
        if kind == "csa":  # index-q RoPE, index scores + top-k; one attention kernel
            assert fused.launches[layer]["indexer"] == 3 and fused.launches[layer]["attention core"] == 1
    assert static.syncs == fused.syncs == 0
    need = needed_kv(cache, rows, 2, model.cfg.index_topk)
    assert 0 < fused.read["fused"] <= 1.5 * need < static.read["static"]
    # the two tokens of a sequence share one attention program: its window read once, not twice
    assert fused.read["attention_l2"] < 0.75 * fused.read["attention_l2_per_token"]


def test_bench_counts_a_quantized_product_as_one_launch():
    """The bench counts the path the GPU runs, which has no prepared CPU weights
    (kernels/cpu_prepared_gemm.py): under its instrumentation a quantized Linear on CPU still goes
    through kernels.fp8_linear, one counted launch."""
    from engine.linear import Linear, WeightFormat
    from perf.bench_gpu_ops import LaunchCounter, instrumented

    lin = Linear(64, 32)
    lin.set_format(WeightFormat.fp8((16, 32)))
    with torch.no_grad():
        lin.weight.copy_(torch.randn(32, 64).to(torch.float8_e4m3fn))
        lin.scale.copy_(torch.ones(2, 2).to(torch.float8_e8m0fnu))
    x = torch.randn(1, 64)
    want = lin(x)                                               # prepared on CPU, outside the bench
    counter = LaunchCounter([])
    with instrumented(counter, []), counter:
        got = lin(x)
    assert sum(sum(c.values()) for c in counter.launches.values()) == 1
    assert torch.equal(got, want)
