"""The MTP draft layer against a plain restatement of the spec (model-spec §2.7).

The reference wraps transformers' own DeepseekV4DecoderLayer (a sliding-window layer with a
learned-router MoE) in the MTP maths written out here, fed with the streams transformers'
model produces, and runs the whole sequence at once; ringserve runs its MTP incrementally.
"""

from __future__ import annotations

import pytest
import torch

from engine.v4.attention import SeqSlice, SequenceContext
from engine.v4.weight_names import export_names
from engine.weights import load_model

transformers = pytest.importorskip("transformers")


def _rms(x, w, eps):
    x32 = x.float()
    return (w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def _reference_mtp(path, ours, ids):
    from safetensors.torch import load_file
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    ref_model = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = ref_model.config
    captured = {}
    ref_model.model.layers[-1].register_forward_hook(lambda m, a, out: captured.setdefault("streams", out))
    with torch.no_grad():
        ref_model(ids[None])
    streams = captured["streams"]  # [1, S, n, D] pre-hc_head

    # A transformers sliding-window decoder layer holding the MTP block's weights.
    layer_cfg = transformers.DeepseekV4Config(**{**cfg.to_dict(), "num_hidden_layers": 1,
                                                 "layer_types": ["sliding_attention"], "mlp_layer_types": ["moe"]})
    block = hf.DeepseekV4DecoderLayer(layer_cfg, 0).float().eval()
    raw = load_file(str(path / "model.safetensors"))
    block_sd = {}
    for name, p in ours.mtp[0].block.state_dict().items():
        hf_name = export_names(f"layers.0.{name}", "transformers", cfg.n_routed_experts)[0][0]
        block_sd[hf_name.removeprefix("model.layers.0.")] = p
    block.load_state_dict(block_sd, strict=True)

    eps, seq = cfg.rms_norm_eps, ids.shape[0]
    emb = ref_model.model.embed_tokens(ids[1:])  # token t_{p+1} for rows p = 0..S-2
    positions = torch.arange(seq - 1)
    emb = torch.where((positions == 0)[:, None], 0.0, emb)
    h = _rms(streams[0, :-1], raw["mtp.0.hnorm.weight"], eps) @ raw["mtp.0.h_proj.weight"].T
    h = h + (_rms(emb, raw["mtp.0.enorm.weight"], eps) @ raw["mtp.0.e_proj.weight"].T)[:, None]
    rotary = hf.DeepseekV4RotaryEmbedding(cfg)
    cos_sin = rotary(h, positions[None], layer_type="main")
    q, k = positions[:, None], positions[None, :]
    mask = torch.where((k <= q) & (k > q - cfg.sliding_window), 0.0, float("-inf"))[None, None]
    with torch.no_grad():
        out = block(h[None], input_ids=ids[None, 1:], position_embeddings={"main": cos_sin},
                    position_ids=positions[None], attention_mask=mask, past_key_values=None)
        head = hf.DeepseekV4HyperHead(cfg)
        head.hc_fn.data, head.hc_base.data = raw["mtp.0.hc_head_fn"], raw["mtp.0.hc_head_base"]
        head.hc_scale.data = raw["mtp.0.hc_head_scale"]
        x = _rms(head(out)[0], raw["mtp.0.norm.weight"], eps)
    return x @ raw["head.weight"].T  # [S-1, vocab]


@torch.no_grad()
def test_mtp_matches_restated_spec(checkpoint_factory):
    path = checkpoint_factory("tiny-upstream", index_topk=64)
    ours = load_model(path, dtype=torch.float32, progress=False)
    assert len(ours.mtp) == 1
    ids = torch.randint(2, ours.cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(4))
    expected = _reference_mtp(path, ours, ids)

    state = ours.new_state()  # the model's layers and the MTP layer's window
    got, pos = [], 0
    for n in [11, 1, 7, 10]:  # main model and MTP advance together, chunk by chunk
        rows = torch.arange(pos, pos + n)
        streams = ours(ids[rows], rows, SequenceContext([SeqSlice(state, pos, 0, n)]))
        keep = rows < len(ids) - 1  # the last position has no next token
        m = int(keep.sum())
        out = ours.mtp[0](ours, streams[:m], ids[rows[:m] + 1], rows[:m], SequenceContext([SeqSlice(state, pos, 0, m)]))
        got.append(ours.mtp[0].logits(ours, out))
        pos += n
    assert (torch.cat(got) - expected).abs().max().item() <= 1e-4
