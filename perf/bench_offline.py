"""Offline throughput: ringserve's engine vs transformers `generate` with batching, one run.

Workload (issue defaults): the `small` preset, N prompts of 64–512 random tokens, 128 output
tokens each (EOS ignored). ringserve gets every prompt at once through the LLM API; transformers
generates in batches of --hf-batch prompts, left-padded, which is how a transformers user
batches (its V4 compressor windows assume unpadded rows, so its outputs under padding are not
meaningful; only its speed is measured). Prints output tokens/s of each and the ratio.

    python perf/bench_offline.py [--num-prompts 256] [--min-len 64] [--max-len 512] [--output-len 128]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.v4.checkpoint import preset_config, random_state, write_checkpoint  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402
from server.llm import LLM  # noqa: E402
from perf.machine import header  # noqa: E402


def run_ringserve(model_dir: str, prompts: list[list[int]], output_len: int, args) -> float:
    with LLM(model_dir, dtype="fp32", max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
             kv_cache_memory_bytes=4 << 30) as llm:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
        elapsed = time.perf_counter() - t0
    assert all(len(o.token_ids) == output_len for o in outs)
    return elapsed


@torch.inference_mode()
def run_transformers(model_dir: str, prompts: list[list[int]], output_len: int, batch: int) -> float:
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(map(len, group))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                       do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    print(header("bench_offline"), flush=True)
    rng = random.Random(0)
    cfg = preset_config("small")
    prompts = [[rng.randrange(2, cfg.vocab_size) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.num_prompts)]
    total_out = args.num_prompts * args.output_len
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(tmp, cfg, random_state(cfg, 0), dtype=torch.float32)
        t_ours = run_ringserve(tmp, prompts, args.output_len, args)
        t_ref = None if args.skip_transformers else run_transformers(tmp, prompts, args.output_len, args.hf_batch)
    print(f"small preset, {args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens, "
          f"{args.output_len} output tokens each, fp32, {torch.get_num_threads()} threads")
    print(f"ringserve     {total_out / t_ours:9.1f} output tok/s  ({t_ours:.1f} s)")
    if t_ref is not None:
        print(f"transformers  {total_out / t_ref:9.1f} output tok/s  ({t_ref:.1f} s, batches of {args.hf_batch})")
        print(f"ratio         {t_ref / t_ours:9.2f}x")


if __name__ == "__main__":
    main()
