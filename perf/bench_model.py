"""ringserve vs transformers on the same `small` checkpoint, side by side in one run.

Prefill: one 1024-token prompt. Decode: 64 greedy steps after a 128-token prompt, at batch 1
and 8 (equal-length prompts, so transformers needs no padding). Both sides run the same dtype
on the same threads; each measurement is the median of --repeats runs.

    python perf/bench_model.py [--dtype fp32|bf16] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.v4.attention import SeqSlice  # noqa: E402
from engine.v4.checkpoint import preset_config, random_state, write_checkpoint  # noqa: E402
from engine.weights import load_model  # noqa: E402
from perf.machine import header, set_cpu_threads  # noqa: E402


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ours_prefill(model, ids: torch.Tensor) -> None:
    state = model.new_state()
    streams = model(ids, torch.arange(len(ids)), [SeqSlice(state, 0, 0, len(ids))])
    model.logits(streams[-1:])


def ours_decode(model, prompts: torch.Tensor, steps: int) -> float:
    """Prefill every prompt (untimed), then time `steps` batched greedy decode steps."""
    batch, plen = prompts.shape
    states = [model.new_state() for _ in range(batch)]
    seqs = [SeqSlice(s, 0, i * plen, plen) for i, s in enumerate(states)]
    streams = model(prompts.flatten(), torch.arange(plen).repeat(batch), seqs)
    next_ids = model.logits(streams[[s.end - 1 for s in seqs]]).argmax(-1)
    t0 = time.perf_counter()
    for step in range(steps):
        pos = plen + step
        seqs = [SeqSlice(s, pos, i, 1) for i, s in enumerate(states)]
        streams = model(next_ids, torch.full((batch,), pos), seqs)
        next_ids = model.logits(streams).argmax(-1)
    return time.perf_counter() - t0


def hf_prefill(model, ids: torch.Tensor) -> None:
    model(ids[None], use_cache=True, logits_to_keep=1)


def hf_decode(model, prompts: torch.Tensor, steps: int) -> float:
    out = model(prompts, use_cache=True, logits_to_keep=1)
    cache, next_ids = out.past_key_values, out.logits[:, -1].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(next_ids[:, None], past_key_values=cache, use_cache=True)
        cache, next_ids = out.past_key_values, out.logits[:, -1].argmax(-1)
    return time.perf_counter() - t0


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    print(header("bench_model"), flush=True)
    set_cpu_threads(args.threads)
    from transformers import DeepseekV4ForCausalLM

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    cfg = preset_config("small")
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(tmp, cfg, random_state(cfg, 0), dtype=dtype)
        ours = load_model(tmp, dtype=dtype, progress=False, load_mtp=False)
        ref = DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, cfg.vocab_size, (args.prefill_len,), generator=gen)
    rows = []
    t_ours = _median_time(lambda: ours_prefill(ours, ids), args.repeats)
    t_ref = _median_time(lambda: hf_prefill(ref, ids), args.repeats)
    rows.append((f"prefill {args.prefill_len} tok, batch 1", args.prefill_len / t_ours, args.prefill_len / t_ref))
    for batch in (1, 8):
        prompts = torch.randint(2, cfg.vocab_size, (batch, 128), generator=gen)
        n = batch * args.decode_steps
        t_ours = statistics.median(ours_decode(ours, prompts, args.decode_steps) for _ in range(args.repeats))
        t_ref = statistics.median(hf_decode(ref, prompts, args.decode_steps) for _ in range(args.repeats))
        rows.append((f"decode {args.decode_steps} steps, batch {batch}", n / t_ours, n / t_ref))
    print(f"small preset, {args.dtype}, {args.threads} threads, median of {args.repeats}")
    print(f"{'measurement':34} {'ringserve tok/s':>16} {'transformers tok/s':>19} {'ratio':>7}")
    for name, ours_tps, ref_tps in rows:
        print(f"{name:34} {ours_tps:16.1f} {ref_tps:19.1f} {ours_tps / ref_tps:6.2f}x")


if __name__ == "__main__":
    main()
