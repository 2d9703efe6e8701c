"""Launches per layer per decode step, and KV / weight bytes read vs stored: counted on CPU.

Counts what a GPU would launch for one static-shape decode (or verify) step of the engine's
`StaticDecodeBackend`, without a GPU, for its two forwards:
  (a) static: the torch static path (engine/v4/attention_decode.py; `fused=False`), what CUDA graphs
      captured before the fused step, and
  (b) fused: engine/v4/fused_decode.py, the path the engine runs on CUDA, with its Triton kernels
      run under the interpreter (`kernels.devices.triton_on_cpu`),
on identical copies of the KV pools. A TorchDispatchMode sees every aten op; each counts as one
launch except views and allocations (no kernel). Calls of `kernels.*` ops outside the Triton
kernels (routing, quantized GEMMs, KV codecs: one CUDA kernel each on a GPU) and Triton kernel
launches count 1 each, with the torch ops inside them not counted. Ops are attributed to a layer
and, by the innermost matching function on the Python stack, to a part. Host syncs (.item(),
nonzero) are counted.

KV bytes: what the step's reads touch (static: aten index on pool storage and kernels.* gathers
by slot count, bucket-padded; fused: the slots each kernel's tables mark valid, once per
program that reads them, a shared attention table once per sequence) against the records the step needs (per sequence: the window records
before the step, its top-k / visible entries, its index keys, the history rows of the compressor
spans it completes; each once). Weight bytes: per GEMM launch the weight it reads (a grouped
GEMM: the experts that got rows), against the model's stored weight bytes.

    python perf/bench_gpu_ops.py [--batch 4] [--q 1] [--prompt 40] [--kv-dtype auto|fp8|fp4] [--topk 2]
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
from kernels import sinkhorn  # noqa: E402
from engine import linear  # noqa: E402
from engine.attention_backend import StepSeq  # noqa: E402
from engine.cuda_graphs import StaticDecodeBackend  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.v4 import fused_decode  # noqa: E402
from engine.v4.attention import SeqSlice, SequenceContext  # noqa: E402
from engine.v4.checkpoint import preset_config, random_state, write_checkpoint  # noqa: E402
from engine.weights import load_model  # noqa: E402
from kernels.devices import triton_on_cpu  # noqa: E402
from perf.machine import cpu_model  # noqa: E402

# aten ops that only make a view or allocate: no kernel on a GPU.
NO_LAUNCH = {"view", "_unsafe_view", "expand", "permute", "transpose", "t", "slice", "select", "unsqueeze",
             "squeeze", "alias", "detach", "as_strided", "unfold", "split", "split_with_sizes", "unbind", "chunk",
             "narrow", "diagonal", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
             "lift_fresh", "_reshape_alias", "view_as", "expand_as", "reshape", "flatten", "unflatten",
             "movedim", "contiguous", "sym_size", "sym_stride", "sym_numel", "is_same_size"}
SYNCS = {"_local_scalar_dense", "item", "nonzero", "equal"}
PARTS = (  # innermost match wins: (function name, file suffix or None)
    ("mHC mix", {("hc_mix_weights", None), ("hc_collapse", None), ("mhc_mix", "__init__.py")}),
    ("mHC expand", {("hc_expand", None), ("mhc_expand", "__init__.py")}),
    ("index q-proj", {("queries", "attention.py")}),
    ("compressor", {("compress", "attention_decode.py"), ("_compress", "fused_decode.py"),
                    ("project", "attention.py")}),
    ("indexer", {("_entries", "fused_decode.py"), ("indexer_topk", "__init__.py")}),
    ("attention core", {("attend", "attention_decode.py"), ("sparse_mla_decode", "__init__.py")}),
    ("attention proj", {("forward", "attention.py"), ("attention", "fused_decode.py")}),
    ("MoE", {("forward", "moe.py"), ("moe", "fused_decode.py")}),
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
    """Counts launches per (section, part), KV pool bytes read / written and weight bytes read."""

    def __init__(self, pools: list[torch.Tensor]):
        super().__init__()
        self.section: object = "model"
        self.launches: dict[object, Counter] = defaultdict(Counter)
        self.syncs = 0
        self.read = Counter()
        self.written = Counter()
        self.weights_read = 0
        self.paused = 0
        self._pools = {p.untyped_storage().data_ptr(): p for p in pools}

    def add(self, n: int = 1) -> None:
        self.launches[self.section][_part(sys._getframe(2))] += n

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


def _valid(slots: torch.Tensor | None) -> int:
    return 0 if slots is None else int((slots >= 0).sum())


@contextmanager
def instrumented(counter: LaunchCounter, kernel_types: list[type]):
    """Count kernels.* calls, Triton launches, the fused kernels' KV traffic and weight reads."""
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
        counter.written["step"] += _valid(slots) * _record_bytes(pool)

    for name, traffic in (("route", None), ("permute", None), ("gather_dequantize", kv_gather),
                          ("quantize_scatter", kv_scatter), ("fp8_linear", None), ("fp4_linear", None),
                          ("fp8_grouped_mm", None), ("fp4_grouped_mm", None)):
        patch(kernels, name, lambda fn, t=traffic: as_launch(fn, t))
    for cls in kernel_types:
        patch(cls, "run", lambda fn: (lambda self, *a, **k: as_launch(lambda: fn(self, *a, **k))()))
    for name, traffic in (("sparse_mla_decode", _attention_traffic(counter)),
                          ("indexer_topk", _indexer_traffic(counter)),
                          ("compressor_step", _compressor_traffic(counter)),
                          ("norm_rope", _store_traffic(counter))):
        patch(kernels, name, lambda fn, t=traffic: _with_traffic(fn, t, counter))
    # The GPU has no prepared CPU weights (kernels/cpu_prepared_gemm.py): every quantized product
    # goes through the kernels.* entry points counted above, as it launches there.
    patch(linear.QuantWeight, "cpu_prepared", lambda fn: (lambda self, weight, scale: None))
    patch(linear.Linear, "forward", lambda fn: _with_weight_bytes(fn, counter))
    patch(linear.GroupedWeight, "grouped_mm", lambda fn: _with_weight_bytes(fn, counter, grouped=True))
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


def _weight_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in (module.weight, module.scale) if t is not None)


def _with_weight_bytes(fn, counter, grouped: bool = False):
    def run(self, x, *args):
        with counter.pause():
            total = _weight_bytes(self)
            if grouped:  # only the experts that got rows are read
                ends = args[0].long()
                rows = torch.diff(ends, prepend=ends.new_zeros(1))
                total = total * int((rows > 0).sum()) // max(1, ends.numel())
            counter.weights_read += total
        return fn(self, x, *args)
    return run


def _table_reads(slots: torch.Tensor, shared: bool) -> int:
    """Records one program reads from a [B, q, N] table: a shared table's columns any row sees,
    once per sequence; a per-row table every valid slot."""
    return int((slots >= 0).any(dim=1).sum()) if shared else _valid(slots)


def _attention_traffic(counter):
    """Records per program (the KV bytes line), and with each sequence's head blocks (what the
    L2 serves), beside the same for per-token programs of 16 heads (the kernel before shared tables)."""
    from kernels.triton.sparse_mla_decode import program_shape

    def traffic(q, sink, wpool, wfmt, wslots, epool=None, efmt="fp32", eslots=None, *a, window_shared=False,
                entries_shared=False, **kw):
        heads = q.shape[2]
        blocks, per_token_blocks = -(-heads // program_shape(q.shape[1])[1]), -(-heads // 16)
        for pool, slots, shared in ((wpool, wslots, window_shared), (epool, eslots, entries_shared)):
            if pool is None or slots is None:
                continue
            rec = _record_bytes(pool)
            counter.read["fused"] += _table_reads(slots, shared) * rec
            counter.read["attention_l2"] += _table_reads(slots, shared) * rec * blocks
            counter.read["attention_l2_per_token"] += _valid(slots) * rec * per_token_blocks
    return traffic


def _indexer_traffic(counter):
    def traffic(q, w, pool, fmt, table, lengths, positions, ratio, topk, *a, **kw):
        seen = torch.minimum(lengths[:, None].long(), (positions.long() + 1).clamp(min=0) // ratio)
        counter.read["fused"] += int(seen.amax(dim=1).sum()) * _record_bytes(pool)  # once per sequence
    return traffic


def _compressor_traffic(counter):
    def traffic(rows, state, row_slots, entry_pool, fmt, entry_slots, *a, **kw):
        span = row_slots.shape[1] - rows.shape[1] + 1
        hist = row_slots[:, : span - 1] >= 0                                     # [B, span−1]
        for b, j in (entry_slots >= 0).nonzero().tolist():                       # history rows each entry pools
            counter.read["fused"] += int(hist[b, j:].sum()) * _record_bytes(state)
        counter.written["fused"] += _valid(entry_slots) * _record_bytes(entry_pool)
        counter.written["fused"] += _valid(row_slots[:, span - 1:]) * _record_bytes(state)
    return traffic


def _store_traffic(counter):
    def traffic(x, norm=0, weight=None, eps=1e-6, cos=None, sin=None, inverse=False, dtype=None, pre_round=False,
                pool=None, pool_fmt="fp32", slots=None):
        if pool is not None:
            counter.written["fused"] += _valid(slots) * _record_bytes(pool)
    return traffic


# ---- the step ------------------------------------------------------------------------------------

def build_model(kv_dtype: str, topk: int, preset: str = "tiny", quantize: str | None = None, **dims):
    """A small random model with every layer kind; CSA takes the sparse branch (top-k < entries)."""
    dims = dict(dims, index_topk=topk)
    if kv_dtype != "auto" and preset == "tiny":
        dims.update(head_dim=128, qk_rope_head_dim=64, index_head_dim=64)   # quantized formats' minimum
    cfg = preset_config(preset, **dims)
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), cfg, random_state(cfg, 0), layout="upstream", dtype=torch.float32,
                         quantize=quantize)
        return load_model(tmp, dtype=torch.float32, progress=False)


def prefilled(model, kv_dtype: str, batch: int, prompt: int, q: int, block_size: int = 16):
    """A cache holding `batch` sequences of lengths spread up to `prompt`, and their decode rows."""
    blocks = batch * (-(-(prompt + 2 * q) // block_size) + 2) + 8
    cache = KVCache.for_model(model, kv_dtype, max_num_seqs=batch, num_full_blocks=blocks, block_size=block_size)
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
    from kernels.triton import (compressor_step, indexer_topk, mhc_expand, mhc_mix, moe_ops, norm_rope,
                                sparse_mla_decode)
    jits = (compressor_step._compressor_step_kernel, indexer_topk._scores_kernel, indexer_topk._topk_kernel,
            mhc_mix._mhc_mix_kernel, mhc_expand._mhc_expand_kernel, moe_ops._gather_rows_kernel,
            moe_ops._swiglu_kernel, moe_ops._combine_kernel, norm_rope._norm_rope_kernel,
            sparse_mla_decode._sparse_mla_decode_kernel)
    return sorted({type(k) for k in jits}, key=str)


@torch.inference_mode()
def measure(model, cache: KVCache, rows: list[StepSeq], q: int,
            ) -> tuple[dict[str, LaunchCounter], dict[str, torch.Tensor]]:
    """Count one static and one fused step from the same pool contents; also return each path's
    logits of the live rows (they must agree)."""
    pools = [t for p in cache.pools.values() for t in p.tensors.values()]
    saved = [t.clone() for t in pools]
    max_len = max(r.start for r in rows) + 4 * q + 64
    out, logits = {}, {}
    for path in ("static", "fused"):
        for t, s in zip(pools, saved):
            t.copy_(s)
        backend = StaticDecodeBackend(model, cache, (len(rows),), (q,), max_len, capture=False,
                                      fused=path == "fused")
        counter = LaunchCounter(pools)
        step = backend.prepare(rows)
        hooks = []
        if path == "static":
            def enter(layer):
                return lambda module, args: setattr(counter, "section", layer)
            hooks = [blk.register_forward_pre_hook(enter(i)) for i, blk in enumerate(model.layers)]
            hooks.append(model.layers[-1].register_forward_hook(lambda *a: setattr(counter, "section", "model")))
        else:
            backend.fused.on_layer = lambda i: setattr(counter, "section", "model" if i is None else i)
        # sinkhorn.torch_loop: the static path's mHC Sinkhorn as CUDA tensors run it (the torch
        # loop), not the one numba call CPU tensors get
        with triton_on_cpu(), sinkhorn.torch_loop(), instrumented(counter, _kernel_types()), counter:
            _, result = step.run(model, None)
        for h in hooks:
            h.remove()
        out[path], logits[path] = counter, result[: len(rows) * q].clone()
    return out, logits


def needed_kv(cache: KVCache, rows: list[StepSeq], q: int, topk: int) -> int:
    """Bytes of the records the step must read, each once per sequence (see the module docstring)."""
    cfg = cache.cfg
    total = 0
    for layer in range(cfg.num_layers):
        refs = cache.layer_pools(layer)
        rec = {name: _record_bytes(ref.pool.tensors[ref.layer]) for name, ref in refs.items()}
        m, kind = cfg.compress_ratios[layer], cfg.layer_kinds[layer]
        for r in rows:
            total += min(r.start, cfg.sliding_window - 1) * rec["window"]
            if not m:
                continue
            entries = (r.start + q) // m
            total += (min(entries, topk) if kind == "csa" else entries) * rec["comp_entries"]
            if kind == "csa":
                total += entries * rec["index_keys"]
            spans = [2 * m] + ([2 * m] if kind == "csa" else []) if kind == "csa" else [m]
            completes = sum((p + 1) % m == 0 for p in range(r.start, r.start + q))
            for span, name in zip(spans, ("comp_rows", "index_rows")):
                total += completes * min(span - 1, r.start) * rec[name]
    return total


def stored_weights(model) -> int:
    return sum(_weight_bytes(m) for m in model.modules() if isinstance(m, linear.QuantWeight))


# ---- report ------------------------------------------------------------------------------------

def report(model, cache: KVCache, rows: list[StepSeq], q: int, counts: dict[str, LaunchCounter]) -> dict:
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
              f"slot tables, hc head, logits; host syncs {c.syncs}")
    print(f"\nper layer kind (mean launches)  {'static':>8s} {'fused':>8s} {'ratio':>7s}")
    totals = Counter()
    for kind in MODEL_KINDS:
        if (kind, "static") not in per_kind:
            continue
        s, f = (sum(per_kind[(kind, p)]) / len(per_kind[(kind, p)]) for p in ("static", "fused"))
        totals["static"] += s * MODEL_KINDS[kind]
        totals["fused"] += f * MODEL_KINDS[kind]
        print(f"  {kind:29s} {s:8.0f} {f:8.0f} {s / f:6.1f}x")
    layers = sum(MODEL_KINDS.values())
    print(f"  {'V4-Flash (2 swa + 21 csa + 20 hca)':29s} {totals['static']:8.0f} {totals['fused']:8.0f} "
          f"{totals['static'] / totals['fused']:6.1f}x   ({totals['static'] / layers:.0f} → "
          f"{totals['fused'] / layers:.0f} per layer)")
    st, fu = counts["static"], counts["fused"]
    need = needed_kv(cache, rows, q, cfg.index_topk)
    static_read, fused_read = st.read["static"], fu.read["fused"] + fu.read["static"]
    print(f"\nKV bytes this step (all {cfg.num_layers} layers, {len(rows)} live sequences; static reads are "
          "bucket-padded):")
    print(f"  records the step needs      {need:>12,d}")
    print(f"  read    static {static_read:>12,d} ({static_read / need:.2f}x)   fused {fused_read:>12,d} "
          f"({fused_read / need:.2f}x)")
    print(f"  written static {st.written['step']:>12,d}   fused {fu.written['step'] + fu.written['fused']:>12,d}")
    l2, l2_token = fu.read["attention_l2"], fu.read["attention_l2_per_token"]
    print(f"  attention reads with every head block: {l2:,d}; per-token programs of 16 heads would read "
          f"{l2_token:,d} ({l2 / max(l2_token, 1):.2f}x)")
    stored = stored_weights(model)
    print(f"weight bytes read this step: static {st.weights_read:,d}, fused {fu.weights_read:,d} "
          f"(stored {stored:,d}; fused reads {fu.weights_read / stored:.2f}x of it)")
    return {"per_layer": {k: totals[k] / layers for k in totals}, "kv_need": need, "kv_read_static": static_read,
            "kv_read_fused": fused_read}


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
    counts, logits = measure(model, cache, rows, args.q)
    gap = (logits["static"] - logits["fused"]).abs().max().item()
    cfg = model.cfg
    triton_mode = "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"
    print(f"CPU: {cpu_model()} | torch {torch.__version__} | Triton {triton_mode}")
    print(f"tiny model: {cfg.num_layers} layers {list(cfg.layer_kinds)}, H={cfg.num_heads} D={cfg.head_dim}, "
          f"window {cfg.sliding_window}, ratios {sorted(set(cfg.compress_ratios) - {0})}, "
          f"index top-k {cfg.index_topk}, "
          f"Sinkhorn {cfg.hc_sinkhorn_iters}; kv {args.kv_dtype}; B={args.batch} q={args.q}, starts "
          f"{[r.start for r in rows]}")
    print("launches = aten ops that are not views/allocations + kernels.* ops + Triton kernels (1 each); "
          f"fused vs static logits: max |Δ| {gap:.1e}")
    report(model, cache, rows, args.q, counts)


if __name__ == "__main__":
    main()
