"""Launches per layer per decode step: today's static torch path vs the fused Triton path (CPU count).

Counts what a GPU would launch for one static-shape decode step, without a GPU:
  (a) `StaticDecodeBackend` (static_decode, what CUDA graphs capture today), and
  (b) `perf.fused_decode.fused_forward` (mhc_mix, compressor_step, indexer_topk, sparse_mla_decode
      plus the torch ops kept around them), on an identical copy of the KV pools.
A TorchDispatchMode sees every aten op; each counts as one launch except views and allocations
(no kernel). Calls of `kernels.*` ops (numba here, one CUDA kernel on a GPU) and Triton kernel
launches count as 1 each, with the torch ops inside them not counted. Ops are attributed to a
layer (block forward) and, by the innermost matching function on the Python stack, to a part:
mHC mix (hc_mix_weights + hc_collapse / mhc_mix), compressor, index q-proj, indexer, attention
core (rest of attend), attention proj, MoE, mHC expand, other. Host syncs (.item()) are listed.

KV bytes: pool reads and writes of the step, measured (static: aten index/index_put on pool
storage and kernels.* gathers/scatters by slot count; fused: the slots each kernel's tables
mark valid, i.e. DRAM-ideal, each record once) next to the KV the live sequences hold.

    python perf/bench_gpu_ops.py [--batch 4] [--q 1] [--prompt 40] [--kv-dtype auto|fp8|fp4]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from engine.attention import SeqSlice, SequenceContext  # noqa: E402
from engine.checkpoint import preset_config, random_state, write_checkpoint  # noqa: E402
from engine.attention_backend import StepSeq  # noqa: E402
from engine.cuda_graphs import StaticDecodeBackend  # noqa: E402
from engine.decode_batch import DecodeBatch  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.weights import load_model  # noqa: E402
from perf import fused_decode  # noqa: E402

# aten ops that only make a view or allocate: no kernel on a GPU.
NO_LAUNCH = {"view", "_unsafe_view", "expand", "permute", "transpose", "t", "slice", "select", "unsqueeze",
             "squeeze", "alias", "detach", "as_strided", "unfold", "split", "split_with_sizes", "unbind", "chunk",
             "narrow", "diagonal", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
             "lift_fresh", "_reshape_alias", "view_as", "expand_as", "reshape", "flatten", "unflatten",
             "movedim", "contiguous", "sym_size", "sym_stride", "sym_numel", "is_same_size"}
SYNCS = {"_local_scalar_dense", "item", "nonzero", "equal"}
PARTS = (  # innermost match wins: (function name, file suffix or None)
    ("mHC mix", {("hc_mix_weights", None), ("hc_collapse", None), ("_mix", "fused_decode.py")}),
    ("mHC expand", {("hc_expand", None)}),
    ("index q-proj", {("queries", "attention.py")}),
    ("compressor", {("compress", "attention_decode.py"), ("_compress", "fused_decode.py"),
                    ("project", "attention.py")}),
    ("indexer", {("select_entries", None), ("indexer_topk", "indexer_topk.py")}),
    ("attention core", {("attend", "attention_decode.py"), ("fused_attend", "fused_decode.py")}),
    ("attention proj", {("forward", "attention.py"), ("fused_attention", "fused_decode.py")}),
    ("MoE", {("forward", "moe.py")}),
)
MODEL_KINDS = {"swa": 2, "csa": 21, "hca": 20}  # DeepSeek-V4-Flash's 43 layers


def _part(frame) -> str:
    while frame is not None:
        name, path = frame.f_code.co_name, frame.f_code.co_filename
        for part, keys in PARTS:
            if (name, None) in keys or any(name == n and s and path.endswith(s) for n, s in keys):
                return part
        frame = frame.f_back
    return "other"


def _aliases_input(name: str, out, args) -> bool:
    """A functional op whose result shares an input's storage made a view or returned its input
    (e.g. .to() / .contiguous() that had nothing to do): no kernel. In-place ops do launch."""
    if name.endswith("_") or not isinstance(out, torch.Tensor):
        return False
    ptr = out.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr for a in args)


class LaunchCounter(TorchDispatchMode):
    """Counts launches per (section, part), and KV pool bytes read / written."""

    def __init__(self, pools: list[torch.Tensor]):
        super().__init__()
        self.section: object = "model"
        self.launches: dict[object, Counter] = defaultdict(Counter)
        self.syncs = 0
        self.read = Counter()
        self.written = Counter()
        self.paused = 0
        self._pools = {p.untyped_storage().data_ptr(): p for p in pools}

    def add(self, n: int = 1, part: str | None = None) -> None:
        self.launches[self.section][part or _part(sys._getframe(2))] += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.paused or name in NO_LAUNCH or _aliases_input(name, out, args):
            return out
        if name in SYNCS:
            self.syncs += 1
        self.launches[self.section][_part(sys._getframe(1))] += 1
        pool = next((a for a in args if isinstance(a, torch.Tensor)
                     and a.untyped_storage().data_ptr() in self._pools), None)
        if pool is not None and name == "index" and isinstance(out, torch.Tensor):
            self.read["static"] += out.numel() * out.element_size()
        elif pool is not None and name in ("index_put", "index_put_"):
            self.written["step"] += args[2].numel() * pool.element_size()
        return out

    @contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def _record_bytes(pool: torch.Tensor) -> int:
    return pool.shape[-1] * pool.element_size()


@contextmanager
def instrumented(counter: LaunchCounter, kernel_types: list[type]):
    """Count kernels.* calls, Triton launches and the fused kernels' KV traffic."""
    saved = []

    def patch(owner, name, wrap):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrap(getattr(owner, name)))

    def as_launch(fn, traffic=None):
        def run(*args, **kwargs):
            counter.add()
            with counter.pause():
                if traffic is not None:
                    traffic(*args, **kwargs)
                return fn(*args, **kwargs)
        return run

    def kv_gather(pool, slots, *a, **k):
        counter.read["static"] += slots.numel() * _record_bytes(pool)

    def kv_scatter(x, pool, slots, fmt):
        counter.written["step"] += int((slots >= 0).sum()) * _record_bytes(pool)

    for name, traffic in (("route", None), ("permute", None), ("gather_dequantize", kv_gather),
                          ("quantize_scatter", kv_scatter)):
        patch(kernels, name, lambda fn, t=traffic: as_launch(fn, t))
    for cls in kernel_types:
        patch(cls, "run", lambda fn: (lambda self, *a, **k: as_launch(lambda: fn(self, *a, **k))()))
    for name, traffic in (("sparse_mla_decode", _attention_traffic(counter)),
                          ("indexer_topk", _indexer_traffic(counter)),
                          ("compressor_step", _compressor_traffic(counter))):
        patch(fused_decode, name, lambda fn, t=traffic: _with_traffic(fn, t, counter))
    try:
        yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


def _with_traffic(fn, traffic, counter):
    def run(*args, **kwargs):
        with counter.pause():
            traffic(*args, **kwargs)
        return fn(*args, **kwargs)
    return run


def _attention_traffic(counter):
    def traffic(q, sink, wpool, wfmt, wslots, epool=None, efmt="fp32", eslots=None, **kw):
        counter.read["fused"] += int((wslots >= 0).sum()) * _record_bytes(wpool)
        if epool is not None and eslots is not None:
            counter.read["fused"] += int((eslots >= 0).sum()) * _record_bytes(epool)
    return traffic


def _indexer_traffic(counter):
    def traffic(q, w, pool, fmt, table, lengths, positions, ratio, topk, **kw):
        seen = torch.minimum(lengths[:, None].long(), (positions.long() + 1).clamp(min=0) // ratio)
        counter.read["fused"] += int(seen.sum()) * _record_bytes(pool)
    return traffic


def _compressor_traffic(counter):
    def traffic(rows, state, row_slots, entry_pool, fmt, entry_slots, *a, **kw):
        span = row_slots.shape[1] - rows.shape[1] + 1
        hist = row_slots[:, : span - 1] >= 0                                     # [B, span−1]
        for b, j in (entry_slots >= 0).nonzero().tolist():                       # history rows each entry pools
            counter.read["fused"] += int(hist[b, j:].sum()) * _record_bytes(state)
        counter.written["fused"] += int((entry_slots >= 0).sum()) * _record_bytes(entry_pool)
        counter.written["fused"] += int((row_slots[:, span - 1:] >= 0).sum()) * _record_bytes(state)
    return traffic


# ---- the step ------------------------------------------------------------------------------------

def build_model(kv_dtype: str, topk: int):
    """A tiny random model with every layer kind (swa, csa, hca, csa); CSA takes the sparse branch."""
    dims = dict(index_topk=topk)
    if kv_dtype != "auto":
        dims.update(head_dim=128, qk_rope_head_dim=64, index_head_dim=64)   # quantized formats' minimum
    cfg = preset_config("tiny", **dims)
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), cfg, random_state(cfg, 0), layout="upstream", dtype=torch.float32)
        return load_model(tmp, dtype=torch.float32, progress=False)


def prefilled(model, kv_dtype: str, batch: int, prompt: int, q: int):
    """A cache holding `batch` sequences of lengths spread up to `prompt`, and their decode rows."""
    cache = KVCache.for_model(model, kv_dtype, max_num_seqs=batch, num_full_blocks=16 * batch + 8, block_size=16)
    rows = []
    for i in range(batch):
        n = max(1, prompt * (i + 1) // batch)
        seq = cache.new_sequence()
        assert cache.allocate(seq, 0, n + q)
        model(torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(i)), torch.arange(n),
              SequenceContext([SeqSlice(seq, 0, 0, n)]))
        rows.append(StepSeq(seq, n, [7 + j for j in range(q)]))
    return cache, rows


def _kernel_types() -> list[type]:
    from kernels.triton import compressor_step, indexer_topk, mhc_mix, sparse_mla_decode
    return sorted({type(k) for k in (compressor_step._compressor_step_kernel, indexer_topk._scores_kernel,
                                     indexer_topk._topk_kernel, mhc_mix._mhc_mix_kernel,
                                     sparse_mla_decode._sparse_mla_decode_kernel)}, key=str)


@torch.inference_mode()
def measure(model, cache: KVCache, rows: list[StepSeq], q: int,
            ) -> tuple[dict[str, LaunchCounter], dict[str, torch.Tensor]]:
    """Count one static step and one fused step from the same pool contents; also return each
    path's output streams of the live rows (they must agree)."""
    pools = [t for p in cache.pools.values() for t in p.tensors.values()]
    saved = [t.clone() for t in pools]
    graphs = StaticDecodeBackend(model, cache, (len(rows),), (q,), max(r.start for r in rows) + 4 * q + 64, capture=False)
    key = graphs.shape_for(len(rows), q, max(r.start + q for r in rows))
    _, size, _, bucket = key
    out, streams = {}, {}
    for path in ("static", "fused"):
        for t, s in zip(pools, saved):
            t.copy_(s)
        batch = DecodeBatch.allocate(cache, size, q, bucket // cache.layout.block_size, graphs.sliding_blocks)
        batch.fill([graphs._row(r, batch) for r in rows])
        counter = LaunchCounter(pools)
        hooks = []
        if path == "static":
            def enter(layer):
                return lambda module, args: setattr(counter, "section", layer)
            hooks = [blk.register_forward_pre_hook(enter(i)) for i, blk in enumerate(model.layers)]
            hooks.append(model.layers[-1].register_forward_hook(lambda *a: setattr(counter, "section", "model")))
        with instrumented(counter, _kernel_types()), counter:
            if path == "static":
                result = model(batch.token_ids, batch.positions, batch)
            else:
                result = fused_decode.fused_forward(
                    model, batch, on_layer=lambda i: setattr(counter, "section", "model" if i is None else i))
            model.logits(result)
        for h in hooks:
            h.remove()
        out[path], streams[path] = counter, result[: len(rows) * q]
    return out, streams


# ---- report ------------------------------------------------------------------------------------

def _live_kv(cache: KVCache, rows: list[StepSeq]) -> int:
    """Bytes of KV the live sequences hold in the pools this step reads (all layers)."""
    total = 0
    for pool in cache.pools.values():
        spec = pool.spec
        for r in rows:
            n = r.start // spec.tokens_per_record
            if spec.group == "sliding":
                n = min(n, spec.window)
            total += n * sum(layer < cache.cfg.num_layers for layer in pool.tensors) * spec.record_bytes
    return total


def report(model, cache: KVCache, rows: list[StepSeq], q: int, counts: dict[str, LaunchCounter]) -> None:
    cfg = model.cfg
    kinds = list(cfg.layer_kinds)
    parts = [p for p, _ in PARTS] + ["other"]
    print(f"\n{'layer':>6s} {'kind':>5s} {'path':>7s} {'total':>6s} " + " ".join(f"{p[:12]:>12s}" for p in parts))
    per_kind: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, kind in enumerate(kinds):
        for path, c in counts.items():
            row = c.launches[i]
            per_kind[(kind, path)].append(sum(row.values()))
            print(f"{i:6d} {kind:>5s} {path:>7s} {sum(row.values()):6d} " + " ".join(f"{row[p]:12d}" for p in parts))
    for path, c in counts.items():
        print(f"{'step':>6s} {'':>5s} {path:>7s} {sum(c.launches['model'].values()):6d}   embedding, rope tables, "
              f"hc head, logits; host syncs {c.syncs}")
    print(f"{'step':>6s} {'':>5s} {'fused':>7s} {sum(counts['fused'].launches['meta'].values()):6d}   "
          f"StepMeta.build (slot tables shared by every layer)")
    print(f"\nper layer kind (mean launches)  {'static':>8s} {'fused':>8s} {'ratio':>7s}")
    totals = Counter()
    for kind in MODEL_KINDS:
        if (kind, "static") not in per_kind:
            continue
        s, f = (sum(per_kind[(kind, p)]) / len(per_kind[(kind, p)]) for p in ("static", "fused"))
        totals["static"] += s * MODEL_KINDS[kind]
        totals["fused"] += f * MODEL_KINDS[kind]
        print(f"  {kind:29s} {s:8.0f} {f:8.0f} {s / f:6.1f}x")
    print(f"  {'V4-Flash (2 swa + 21 csa + 20 hca)':29s} {totals['static']:8.0f} {totals['fused']:8.0f} "
          f"{totals['static'] / totals['fused']:6.1f}x")
    st, fu = counts["static"], counts["fused"]
    print(f"\nKV bytes this step (all {cfg.num_layers} layers, {len(rows)} live sequences; static reads are "
          "bucket-padded):")
    print(f"  live KV held by the batch   {_live_kv(cache, rows):>12,d}")
    print(f"  read   static {st.read['static']:>12,d}   fused {fu.read['fused'] + fu.read['static']:>12,d}")
    print(f"  written static {st.written['step']:>11,d}   fused {fu.written['step'] + fu.written['fused']:>12,d}")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--q", type=int, default=1, help="tokens per sequence (1 decode, 1+k verify)")
    parser.add_argument("--prompt", type=int, default=40, help="longest prompt (others spread below it)")
    parser.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8", "fp4"))
    parser.add_argument("--topk", type=int, default=2, help="index top-k (below the entry count: sparse CSA)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model = build_model(args.kv_dtype, args.topk)
    cache, rows = prefilled(model, args.kv_dtype, args.batch, args.prompt, args.q)
    counts, streams = measure(model, cache, rows, args.q)
    gap = (streams["static"] - streams["fused"]).abs().max().item()
    cfg = model.cfg
    triton_mode = "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"
    print(f"CPU: {_cpu_model()} | torch {torch.__version__} | Triton {triton_mode}")
    print(f"tiny model: {cfg.num_layers} layers {list(cfg.layer_kinds)}, H={cfg.num_heads} D={cfg.head_dim}, "
          f"window {cfg.sliding_window}, ratios {sorted(set(cfg.compress_ratios) - {0})}, "
          f"index top-k {cfg.index_topk}, "
          f"Sinkhorn {cfg.hc_sinkhorn_iters}; kv {args.kv_dtype}; B={args.batch} q={args.q}, starts "
          f"{[r.start for r in rows]}")
    print("launches = aten ops that are not views/allocations + kernels.* ops + Triton kernels (1 each); "
          f"fused vs static output streams: max |Δ| {gap:.1e}")
    report(model, cache, rows, args.q, counts)


if __name__ == "__main__":
    main()
