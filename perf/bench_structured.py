"""Structured outputs' cost on CPU: decode tok/s with a grammar vs without, side by side.

For each batch size, the same prompts decode the same number of tokens twice per round — once
unconstrained, once under a JSON Schema that cannot end before `--tokens` (an array of at
least 1000 integers: EOS stays masked, so both runs decode every token), its compile already
cached — after one warm-up round, and the ratio of decode throughputs is printed
(median over rounds). Also: the grammar compile time of every test schema
(tests/structured_schemas.py) against the model's vocabulary, p50/p99, and the share of the
constrained decode step spent filling and applying bitmasks (engine/step_sampling.py
`_apply_grammars`), and MTP's acceptance with and without a grammar (`--speculative-tokens K`,
greedy: the drafts are verified under the grammar, so a draft the grammar forbids is rejected).

    python perf/bench_structured.py [--model-dir DIR] [--batch 1 16 64] [--tokens 64] [--rounds 3]
        [--speculative-tokens 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from perf.machine import header, set_cpu_threads  # noqa: E402

NEVER_ENDING = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1000}


def _decode_rate(engine, prompts: list[list[int]], params) -> tuple[float, float]:
    """(decode tokens per second after the first step, seconds in _apply_grammars)."""
    from engine import step_sampling

    masking = [0.0]
    real = step_sampling.StepSampler._apply_grammars

    def timed(self, *args):
        t0 = time.perf_counter()
        try:
            return real(self, *args)
        finally:
            masking[0] += time.perf_counter() - t0

    step_sampling.StepSampler._apply_grammars = timed
    try:
        for i, p in enumerate(prompts):
            engine.add_request(i, p, params)
        while engine.waits_on_grammars_only or not any(r.num_output_tokens for r in engine.scheduler.running):
            engine.step()  # prefill (and a cached grammar's start), not timed
        masking[0] = 0.0
        t0, tokens = time.perf_counter(), 0
        while engine.has_work:
            tokens += sum(len(d.token_ids) for d in engine.step().deltas)
        return tokens / (time.perf_counter() - t0), masking[0]
    finally:
        step_sampling.StepSampler._apply_grammars = real


def throughput(model, tokenizer, batches: list[int], tokens: int, rounds: int, verbose: bool = True) -> None:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from ipc.messages import SamplingParams, StructuredOutput

    spec = StructuredOutput("json", json.dumps(NEVER_ENDING))
    print(f"{'batch':>5} {'plain tok/s':>12} {'grammar tok/s':>14} {'ratio':>6} {'bitmask share':>14}")
    for b in batches:
        engine = Engine(model, EngineConfig(max_num_seqs=b, max_num_batched_tokens=max(512, 16 * b),
                                            kv_cache_memory_bytes=256 << 20, block_size=16,
                                            enable_prefix_caching=False))
        prompts = [tokenizer.encode(f"Numbers {i}:").ids for i in range(b)]
        plain = SamplingParams(max_tokens=tokens, ignore_eos=True)
        constrained = SamplingParams(max_tokens=tokens, ignore_eos=True, structured=spec)
        engine.grammar_for(constrained).compile.result()  # a warm cache, as in steady serving
        ratios, shares, rates = [], [], []
        _decode_rate(engine, prompts, plain)  # warm-up: kernels compiled for this batch's shapes
        _decode_rate(engine, prompts, constrained)
        for _ in range(rounds):
            free, _ = _decode_rate(engine, prompts, plain)
            bound, mask_s = _decode_rate(engine, prompts, constrained)
            ratios.append(bound / free)
            shares.append(mask_s * bound / (tokens * b))  # masking seconds / constrained decode seconds
            rates.append((free, bound))
            if verbose:
                print(f"#   batch {b}: plain {free:.1f} tok/s, grammar {bound:.1f} tok/s, masking {mask_s:.3f} s")
        free, bound = statistics.median(r[0] for r in rates), statistics.median(r[1] for r in rates)
        print(f"{b:>5} {free:>12.1f} {bound:>14.1f} {statistics.median(ratios):>5.2f}x "
              f"{statistics.median(shares):>13.1%}")


# A document the built-in model (trained on Python's documentation) can write something like.
DOC_SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "summary": {"type": "string"},
                                               "see_also": {"type": "array", "items": {"type": "string"}}},
              "required": ["title", "summary", "see_also"]}


def acceptance(model, tokenizer, k: int, tokens: int) -> None:
    """MTP acceptance per drafted token, free vs under DOC_SCHEMA (8 greedy requests each)."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from ipc.messages import SamplingParams, StructuredOutput

    if not len(model.mtp):
        print("# acceptance: the model has no MTP layer")
        return
    prompts = [tokenizer.encode(text).ids for text in ("The function returns", "A module is", "Exceptions are",
                                                        "The list type", "Dictionaries map", "A class defines",
                                                        "The import statement", "Iterators yield")]
    kinds = {"free": SamplingParams(max_tokens=tokens, temperature=0.0),
             "json schema": SamplingParams(max_tokens=tokens, temperature=0.0,
                                           structured=StructuredOutput("json", json.dumps(DOC_SCHEMA)))}
    for name, params in kinds.items():
        engine = Engine(model, EngineConfig(max_num_seqs=8, kv_cache_memory_bytes=256 << 20, block_size=16,
                                            speculative_tokens=k, adaptive_speculation=False,
                                            enable_prefix_caching=False))
        for i, ids in enumerate(prompts):
            engine.add_request(i, ids, params)
        while engine.has_work:
            engine.step()
        st = engine.stats
        per = [a / max(1, st.spec_drafts) for a in st.spec_accepted_per_position]
        mean = sum(st.spec_accepted_per_position) / max(1, st.spec_draft_tokens)
        print(f"# MTP k={k} {name:>11}: {mean:.1%} of {st.spec_draft_tokens} drafted tokens accepted; "
              f"per position {', '.join(f'{a:.0%}' for a in per)}")


def compile_times(model_dir: Path, vocab: int, eos: list[int]) -> None:
    from engine.structured.compiler import compile_spec, make_compiler
    from ipc.messages import StructuredOutput
    from tests.structured_schemas import SCHEMAS

    compiler = make_compiler(model_dir, vocab, eos, json_text=True)
    seconds = []
    for schema in SCHEMAS.values():
        t0 = time.perf_counter()
        compile_spec(compiler, StructuredOutput("json", json.dumps(schema)))
        seconds.append(time.perf_counter() - t0)
    seconds.sort()
    p99 = seconds[min(len(seconds) - 1, round(0.99 * (len(seconds) - 1)))]
    print(f"grammar compile, {len(seconds)} test schemas, vocab {vocab}: p50 {statistics.median(seconds) * 1e3:.1f} ms, "
          f"p99 {p99 * 1e3:.1f} ms, max {seconds[-1] * 1e3:.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=None, help="default: the built-in model")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--speculative-tokens", type=int, default=3, help="MTP drafts for the acceptance check (0: skip)")
    args = p.parse_args()
    set_cpu_threads(args.threads)
    from tokenizers import Tokenizer

    from engine.weights import load_model
    from server.builtin import builtin_model_dir

    model_dir = args.model_dir or builtin_model_dir()
    print(header("structured outputs: constrained vs unconstrained decode"))
    model = load_model(model_dir, dtype=torch.float32, progress=False)
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    print(f"# model {model_dir} ({model.cfg.vocab_size} tokens), {args.tokens} decode tokens per request, "
          f"{args.rounds} rounds (medians)")
    compile_times(Path(model_dir), model.cfg.vocab_size, list(model.cfg.eos_token_ids))
    if args.speculative_tokens:
        acceptance(model, tokenizer, args.speculative_tokens, args.tokens)
    throughput(model, tokenizer, args.batch, args.tokens, args.rounds)


if __name__ == "__main__":
    main()
