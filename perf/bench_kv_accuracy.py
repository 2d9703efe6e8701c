"""Accuracy cost of the quantized KV formats on the `small` preset.

A 256-step greedy run with bf16 KV fixes a reference path; each quantized --kv-dtype is then
teacher-forced along that path (one chunked forward) and compared step by step: top-1 agreement
with the reference token and mean |Δ logprob| of the reference token. Also prints the bytes per
token of each layout for the same model.

    python perf/bench_kv_accuracy.py [--steps 256] [--prompt-len 128] [--prompts 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.v4.attention import SeqSlice, SequenceContext  # noqa: E402
from engine.v4.checkpoint import preset_config, random_state, write_checkpoint  # noqa: E402
from engine.weights import load_model  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402
from perf.machine import header  # noqa: E402


@torch.inference_mode()
def teacher_forced(model, kv_dtype: str, prompt: list[int], path: list[int]) -> torch.Tensor:
    """Logprobs [steps, vocab] at each generated position with `kv_dtype` pages, chunked by 64."""
    cache = KVCache.for_model(model, kv_dtype, max_num_seqs=1, max_tokens_per_step=64, num_full_blocks=64)
    seq = cache.new_sequence()
    ids = torch.tensor(prompt + path)
    out = []
    for start in range(0, len(ids), 64):
        end = min(len(ids), start + 64)
        assert cache.allocate(seq, start, end)
        streams = model(ids[start:end], torch.arange(start, end), SequenceContext([SeqSlice(seq, start, 0, end - start)]))
        out.append(torch.log_softmax(model.logits(streams), dim=-1))
    return torch.cat(out)[len(prompt) - 1 : -1]


def greedy_paths(model, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Each prompt's greedy continuation through the engine, with bf16 KV."""
    engine = Engine(model, EngineConfig(kv_dtype="bf16", max_num_seqs=len(prompts), num_kv_blocks=64 * len(prompts)))
    paths: list[list[int]] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt, SamplingParams(max_tokens=steps, ignore_eos=True))
    while engine.has_work:
        for d in engine.step().deltas:
            paths[d.request_id].extend(d.token_ids)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()
    print(header("bench_kv_accuracy"), flush=True)
    cfg = preset_config("small")
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(tmp, cfg, random_state(cfg, 0), dtype=torch.float32)
        model = load_model(tmp, dtype=torch.float32, progress=False, load_mtp=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    paths = greedy_paths(model, prompts, args.steps)
    print(f"small preset, {args.prompts} prompts × {args.steps} greedy steps, reference = bf16 KV greedy path")
    print(f"{'kv-dtype':9} {'global B/token':>15} {'top-1 agreement':>16} {'mean |Δ logprob|':>17}")
    for kv_dtype in ("bf16", "fp8", "fp4"):
        agree, delta, n = 0.0, 0.0, 0
        ref_lp = None
        for prompt, path in zip(prompts, paths):
            target = torch.tensor(path)
            lp = teacher_forced(model, kv_dtype, prompt, path)
            base = teacher_forced(model, "bf16", prompt, path) if kv_dtype != "bf16" else lp
            agree += (lp.argmax(-1) == target).float().sum().item()
            delta += (lp.gather(1, target[:, None]) - base.gather(1, target[:, None])).abs().sum().item()
            n += len(path)
        bytes_per_token = KVCache.for_model(model, kv_dtype, max_num_seqs=1, num_full_blocks=2).layout.global_bytes_per_token
        print(f"{kv_dtype:9} {bytes_per_token:15.1f} {agree / n:16.4f} {delta / n:17.5f}")


if __name__ == "__main__":
    main()
