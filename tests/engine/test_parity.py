"""ringserve's V4 against transformers' DeepseekV4ForCausalLM on tiny random configs (fp32)."""

from __future__ import annotations

import pytest
import torch

import engine.v4.attention
from engine.v4.attention import SeqSlice, SequenceContext
from engine.weights import load_model
from ipc.messages import SamplingParams
from reference_driver import generate

transformers = pytest.importorskip("transformers")

# Three geometries: hash layers, CSA, HCA with a small rate, prompts longer than the window.
# index_topk ≥ the number of compressed entries so ReLU ties at 0 cannot change the selection.
CONFIGS = {
    "tiny-upstream": dict(layout="upstream", index_topk=64),
    "swapped-transformers": dict(
        layout="transformers", index_topk=64, num_hidden_layers=5,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                     "heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
    ),
    "wide-upstream": dict(
        layout="upstream", index_topk=64, num_attention_heads=8, o_groups=4, sliding_window=16, hc_mult=2,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        n_routed_experts=16, num_experts_per_tok=4, index_n_heads=2, seed=3,
    ),
}
PROMPT_LEN = 41


def _load_pair(checkpoint_factory, name):
    overrides = dict(CONFIGS[name])
    layout, seed = overrides.pop("layout"), overrides.pop("seed", 0)
    path = checkpoint_factory(name, layout=layout, seed=seed, **overrides)
    ours = load_model(path, dtype=torch.float32, progress=False)
    ref = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, ref


def _prompt(vocab: int, n: int = PROMPT_LEN, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(checkpoint_factory, name):
    ours, ref = _load_pair(checkpoint_factory, name)
    ids = _prompt(ours.cfg.vocab_size)
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
        got = ours.logits(ours(ids, torch.arange(len(ids)), SequenceContext([SeqSlice(ours.new_state(), 0, 0, len(ids))])))
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_tokens_match_transformers(checkpoint_factory, name):
    ours, ref = _load_pair(checkpoint_factory, name)
    ids = _prompt(ours.cfg.vocab_size, seed=2)
    with torch.no_grad():
        expected = ref.generate(ids[None], max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = generate(ours, [ids.tolist()], SamplingParams(max_tokens=32, ignore_eos=True))[0].token_ids
    assert got == expected[0, len(ids):].tolist()


def test_small_topk_selects_the_reference_sets(checkpoint_factory, monkeypatch):
    """With index_topk below the entry count, each query's selected entries equal the
    reference's, up to exchanging entries whose scores tie at the k-th value."""
    path = checkpoint_factory("tiny-topk2", index_topk=2)
    ours = load_model(path, dtype=torch.float32, progress=False)
    ref = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = _prompt(ours.cfg.vocab_size, n=37)
    ref_sets, our_sets = [], []
    hooks = [m.register_forward_hook(lambda mod, args, out: ref_sets.append(out[0]))
             for m in ref.modules() if type(m).__name__ == "DeepseekV4Indexer"]
    select = engine.v4.attention.top_k_entries

    def recording(scores, visible, k):  # the per-sequence path's top-k, one call per CSA layer
        picked, valid = select(scores, visible, k)
        mask = torch.zeros_like(visible).scatter_(-1, picked, valid)
        our_sets.append((mask, scores.masked_fill(~visible, float("-inf"))))
        return picked, valid

    monkeypatch.setattr(engine.v4.attention, "top_k_entries", recording)
    with torch.no_grad():
        ref(ids[None])
        ours(ids, torch.arange(len(ids)), SequenceContext([SeqSlice(ours.new_state(), 0, 0, len(ids))]))
    for h in hooks:
        h.remove()
    assert len(ref_sets) == len(our_sets) > 0
    compared = 0
    for ref_idx, (mask, scores) in zip(ref_sets, our_sets):
        for t in range(len(ids)):
            want = {int(i) for i in ref_idx[t] if i >= 0}
            have = set(torch.nonzero(mask[t]).flatten().tolist())
            assert len(want) == len(have), t
            for i in want ^ have:  # any disagreement must sit on a tie at the boundary
                kth = scores[t][sorted(have, key=lambda e: scores[t][e])[0]]
                assert torch.isclose(scores[t][i], kth, atol=1e-6), (t, i)
            compared += 1
    assert compared == len(ref_sets) * len(ids)
