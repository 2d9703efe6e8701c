"""The V4.1 engine against DeepSeek's golden outputs (`shared/golden/deepseek-v4.1/c*`), primary
variant, in the engine's default (reference) numerics:
  * every prompt of every configuration, all three in one batch: greedy tokens identical to
    REF's; the largest chosen-token logprob difference is printed (bound 0.5 nats, REF's own
    noise being up to 0.38);
  * the same with DSpark drafting and verifying (k = the block size): identical tokens;
  * index top-k sets of the last prompt (topk.json), ties at the cut-off aside: the first index
    source at all but at most one step, later index layers at least 80 % overlap on average
    (they inherit that prompt's drift from REF, tests/v41/README.md "What is left"), and no
    pick outside the candidate blocks;
  * DSpark drafting driven as REF drives it (prefill, then one token per forward, a draft after
    each): every (start_pos, anchor) identical, drafts identical and confidences within 0.02 at
    the steps whose main logits reproduce REF's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from engine.v41.attention import Chunk
from engine.v41.dspark import DSpark
from engine.v41.kv_cache import V41KVCache
from tests.v41.engine_helpers import EngineRun, load, run_engine

EXACT_STEP = 1e-4


@dataclass
class Golden:
    name: str
    golden: dict
    logprobs: dict[str, torch.Tensor]
    topk: dict
    model: object
    run: EngineRun


@pytest.fixture(scope="module", params=["c1", "c2"])
def golden(request, golden_root) -> Golden:
    d = golden_root / request.param
    g = json.loads((d / "golden.json").read_text())
    topk = json.loads((d / "topk.json").read_text())
    model = load(d)
    run = run_engine(model, g["prompts"], g["max_new_tokens"], trace_prompt=topk["prompt_index"])
    return Golden(request.param, g, load_file(str(d / "logprobs.safetensors")), topk, model, run)


def test_greedy_tokens_identical_batched(golden):
    assert golden.run.tokens == golden.golden["tokens"]
    worst = []
    for i, tokens in enumerate(golden.golden["tokens"]):
        ref = golden.logprobs[f"prompt{i}"].gather(1, torch.tensor(tokens)[:, None])[:, 0]
        worst.append(float((torch.tensor(golden.run.logprobs[i]) - ref).abs().max()))
    print(f"\n{golden.name}: max |Δ chosen logprob| per prompt {[round(x, 4) for x in worst]}")
    assert max(worst) <= 0.5


def test_greedy_tokens_identical_with_dspark(golden):
    """The two shorter prompts (the long one adds time, not coverage)."""
    k = golden.model.cfg.v41.dspark_block_size
    run = run_engine(golden.model, golden.golden["prompts"][:2], golden.golden["max_new_tokens"], speculative_tokens=k)
    assert run.tokens == golden.golden["tokens"][:2]
    stats = run.engine.stats
    assert stats.spec_drafts > 0 and len(stats.spec_accepted_per_position) == k
    print(f"\n{golden.name}: DSpark acceptance per position {stats.spec_accepted_per_position} "
          f"of {stats.spec_drafts} verifications")


def test_index_topk_sets(golden):
    """Per decode step (and the last prefill position) each index source's chosen set."""
    topk = golden.topk
    steps = [topk["last_prefill_position"]] + [s["sets"] for s in topk["decode_steps"]]
    traces = golden.run.traces
    assert len(traces) >= len(steps)
    per_layer: dict[str, list[tuple[bool, float]]] = {}
    for trace, sets in zip(traces, steps):
        for layer, theirs in sets.items():
            chosen, scores = trace[int(layer)]
            mine = {j for j in chosen[-1].tolist() if j >= 0}
            assert len(mine) == len(theirs)
            row = scores[-1].float()
            assert torch.isfinite(row[sorted(mine)]).all()  # never a masked or non-candidate pick
            cut = row[sorted(mine)].min()
            tie_only = all(row[j] == cut for j in mine ^ set(theirs))
            per_layer.setdefault(layer, []).append((mine == set(theirs) or tie_only,
                                                    len(mine & set(theirs)) / len(theirs)))
    first = str(min(golden.model.cfg.v41.index_source_layers))
    for layer, rows in per_layer.items():
        overlap = [o for _, o in rows]
        print(f"\n{golden.name} layer {layer}: sets equal {sum(e for e, _ in rows)}/{len(rows)}, "
              f"mean overlap {sum(overlap) / len(overlap):.3f}")
        assert sum(overlap) / len(overlap) >= 0.8 and min(overlap) >= 0.5
    assert sum(not e for e, _ in per_layer[first]) <= 1


def test_dspark_drafts_as_ref_drives_them(golden):
    """c1 prompt 0 and c2 prompt 1: the prompts whose main logits reproduce REF's at most steps."""
    model, g = golden.model, golden.golden
    prompt = {"c1": 0, "c2": 1}[golden.name]
    cache = V41KVCache.for_model(model, "auto", 1, 512, num_full_blocks=64, block_size=16)
    seq, dspark = cache.new_sequence(), DSpark(model)
    tokens = g["prompts"][prompt]
    ref_lp = golden.logprobs[f"prompt{prompt}"]
    drafts, pos, equal, checked = [], 0, 0, 0
    chunk_tokens = tokens
    for step in range(g["max_new_tokens"]):
        cache.allocate(seq, pos, pos + len(chunk_tokens))
        chunks = [Chunk(seq, pos, 0, len(chunk_tokens))]
        out = model(torch.tensor(chunk_tokens), chunks)
        dspark.observe(out.main_hidden, out.chunks)
        logits = model.logits(out.x[-1:])[0]
        exact = float((torch.log_softmax(logits, -1) - ref_lp[step]).abs().max()) <= EXACT_STEP
        nxt = int(logits.argmax())
        assert nxt == g["tokens"][prompt][step]
        if step:  # REF drafts after decode forwards only
            ref = g["dspark_drafts"][prompt][step - 1]
            d = dspark.draft(seq, nxt, pos)
            assert (pos, nxt) == (ref["start_pos"], ref["anchor"])
            equal += d.tokens == ref["draft"]
            if exact:
                checked += 1
                assert d.tokens == ref["draft"]
                assert (d.confidence - torch.tensor(ref["confidence"])).abs().max() <= 0.02
        pos += len(chunk_tokens)
        chunk_tokens = [nxt]
        if step + 1 == g["max_new_tokens"]:
            break
    print(f"\n{golden.name} prompt {prompt}: drafts equal {equal}/{g['max_new_tokens'] - 1}, {checked} exact steps")
