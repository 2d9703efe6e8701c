"""DeepSeek-V4's checkpoint tensor names, in the layouts users have, and their mapping to its parameters.

Upstream layout (released checkpoints):  `layers.N.attn.wq_a.weight`, `.scale` for FP8/FP4
scales, routed experts one tensor per expert (`layers.N.ffn.experts.E.w1.weight`).
Transformers layout (its in-memory module names): `model.layers.N.self_attn.q_a_proj.weight`,
experts stacked (`model.layers.N.mlp.experts.gate_up_proj`).
Saved-by-transformers layout (what `DeepseekV4ForCausalLM.save_pretrained` writes in 5.23: its
conversion mapping reversed): upstream layer names under a `model.` prefix, except the KV norm
(`attn.norm`), plus `model.embed_tokens`, `model.hc_head.hc_*`, `model.norm` and `head.weight`.
MTP weights use the upstream `mtp.0.*` names in every layout (transformers ignores them).

A checkpoint tensor maps to a `Target` (engine/weight_names.py): the internal parameter name,
plus for upstream experts the expert index and which part of the stacked tensor it fills.
"""

from __future__ import annotations

import re

from ..weight_names import EXPERT_PARTS, Target, scale_name_of


# (upstream suffix, transformers suffix, internal suffix) for every per-layer tensor except routed experts.
_LAYER_TABLE: tuple[tuple[str, str, str], ...] = (
    ("attn_norm.weight", "input_layernorm.weight", "attn_norm"),
    ("ffn_norm.weight", "post_attention_layernorm.weight", "ffn_norm"),
    ("hc_attn_fn", "attn_hc.fn", "hc_attn.fn"),
    ("hc_attn_base", "attn_hc.base", "hc_attn.base"),
    ("hc_attn_scale", "attn_hc.scale", "hc_attn.scale"),
    ("hc_ffn_fn", "ffn_hc.fn", "hc_ffn.fn"),
    ("hc_ffn_base", "ffn_hc.base", "hc_ffn.base"),
    ("hc_ffn_scale", "ffn_hc.scale", "hc_ffn.scale"),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight", "attn.wq_a.weight"),
    ("attn.q_norm.weight", "self_attn.q_a_norm.weight", "attn.q_norm"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight", "attn.wq_b.weight"),
    ("attn.wkv.weight", "self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("attn.kv_norm.weight", "self_attn.kv_norm.weight", "attn.kv_norm"),
    ("attn.wo_a.weight", "self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("attn.wo_b.weight", "self_attn.o_b_proj.weight", "attn.wo_b.weight"),
    ("attn.attn_sink", "self_attn.sinks", "attn.attn_sink"),
    ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("attn.compressor.ape", "self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight", "attn.compressor.norm"),
    ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight",
     "attn.indexer.weights_proj.weight"),
    ("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight",
     "attn.indexer.compressor.wkv.weight"),
    ("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight",
     "attn.indexer.compressor.wgate.weight"),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight",
     "attn.indexer.compressor.norm"),
    ("ffn.gate.weight", "mlp.gate.weight", "ffn.gate"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias", "ffn.gate_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid", "ffn.tid2eid"),
    ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight", "ffn.shared_w1.weight"),
    ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight", "ffn.shared_w3.weight"),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight", "ffn.shared_w2.weight"),
    ("", "mlp.experts.gate_up_proj", "ffn.experts.w13.weight"),
    ("", "mlp.experts.down_proj", "ffn.experts.w2.weight"),
)
_TOP_TABLE: tuple[tuple[str, str, str], ...] = (
    ("embed.weight", "model.embed_tokens.weight", "embed"),
    ("head.weight", "lm_head.weight", "head"),
    ("norm.weight", "model.norm.weight", "norm"),
    ("hc_head_fn", "model.hc_head.hc_fn", "hc_head.fn"),
    ("hc_head_base", "model.hc_head.hc_base", "hc_head.base"),
    ("hc_head_scale", "model.hc_head.hc_scale", "hc_head.scale"),
)
# MTP-only tensors (upstream names after `mtp.0.`), besides its embedded block.
_MTP_TABLE: tuple[tuple[str, str], ...] = (
    ("enorm.weight", "enorm"),
    ("hnorm.weight", "hnorm"),
    ("e_proj.weight", "e_proj.weight"),
    ("h_proj.weight", "h_proj.weight"),
    ("norm.weight", "norm"),
    ("hc_head_fn", "hc_head.fn"),
    ("hc_head_base", "hc_head.base"),
    ("hc_head_scale", "hc_head.scale"),
)


_UP_LAYER = {up: internal for up, _, internal in _LAYER_TABLE if up}
_HF_LAYER = {hf: internal for _, hf, internal in _LAYER_TABLE}
_UP_TOP = {up: internal for up, _, internal in _TOP_TABLE}
_HF_TOP = {hf: internal for _, hf, internal in _TOP_TABLE}
_UP_MTP = dict(_MTP_TABLE)
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MTP_RE = re.compile(r"^mtp\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


_SAVED_LAYER_RE = re.compile(r"^model\.layers\.\d+\.(attn|ffn)\.")
# Saved-by-transformers names that differ from the upstream ones by more than the prefix.
_SAVED_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight", "head.weight": "head.weight",
              "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
              "model.hc_head.hc_scale": "hc_head_scale"}


def detect_layout(names: list[str]) -> str:
    """'saved-transformers' if layer tensors keep upstream names under `model.`, 'transformers'
    if any other tensor uses the transformers prefix, else 'upstream'."""
    if any(_SAVED_LAYER_RE.match(n) for n in names):
        return "saved-transformers"
    return "transformers" if any(n.startswith(("model.", "lm_head.")) for n in names) else "upstream"


def _saved_to_upstream(name: str) -> str | None:
    """The upstream name of a saved-by-transformers tensor (None if it is not one)."""
    if name in _SAVED_TOP:
        return _SAVED_TOP[name]
    m = _HF_LAYER_RE.match(name)
    if m is None:
        return None
    suffix = m.group(2)
    if suffix == "attn.norm.weight":  # transformers' name for the KV latent's norm
        suffix = "attn.kv_norm.weight"
    return f"layers.{m.group(1)}.{suffix}"


def _layer_target(prefix: str, suffix: str, table: dict[str, str]) -> Target | None:
    if suffix in table:
        return Target(f"{prefix}.{table[suffix]}")
    m = _EXPERT_RE.match(suffix) if table is _UP_LAYER else None
    if m:
        internal, part = EXPERT_PARTS[m.group(2)]
        return Target(f"{prefix}.{internal}", int(m.group(1)), part)
    return None


def target_of(name: str, layout: str) -> Target | None:
    """Internal target of a checkpoint weight name (not of its `.scale`), or None if unknown."""
    m = _MTP_RE.match(name)
    if m:
        idx, suffix = m.groups()
        if suffix in _UP_MTP:
            return Target(f"mtp.{idx}.{_UP_MTP[suffix]}")
        return _layer_target(f"mtp.{idx}.block", suffix, _UP_LAYER)
    if layout == "saved-transformers":
        upstream = _saved_to_upstream(name)
        return target_of(upstream, "upstream") if upstream is not None else None
    if layout == "upstream":
        if name in _UP_TOP:
            return Target(_UP_TOP[name])
        m = _LAYER_RE.match(name)
        return _layer_target(f"layers.{m.group(1)}", m.group(2), _UP_LAYER) if m else None
    if name in _HF_TOP:
        return Target(_HF_TOP[name])
    m = _HF_LAYER_RE.match(name)
    return _layer_target(f"layers.{m.group(1)}", m.group(2), _HF_LAYER) if m else None


def export_names(internal: str, layout: str, num_experts: int) -> list[tuple[str, int | None, str | None]]:
    """Checkpoint names (with expert index / part) an internal parameter is written as. A
    quantized weight's `.scale` goes under its weight's scale name (`.scale` upstream,
    `.weight_scale_inv` / `_scale_inv` in the transformers layout)."""
    try:
        return _export_names(internal, layout, num_experts)
    except KeyError:
        if not internal.endswith(".scale"):
            raise
    weight = internal[: -len(".scale")] + ".weight"
    return [(_scale_export_name(name), e, part) for name, e, part in _export_names(weight, layout, num_experts)]


def _scale_export_name(weight_name: str) -> str:
    transformers = weight_name.startswith(("model.", "lm_head."))
    if weight_name.endswith(".weight"):
        return scale_name_of(weight_name)[1 if transformers else 0]
    return scale_name_of(weight_name)[0]


def _export_names(internal: str, layout: str, num_experts: int) -> list[tuple[str, int | None, str | None]]:
    parts = internal.split(".")
    if parts[0] == "mtp":
        prefix, rest = f"mtp.{parts[1]}", ".".join(parts[2:])
        inverse_mtp = {v: k for k, v in _MTP_TABLE}
        if rest in inverse_mtp:
            return [(f"{prefix}.{inverse_mtp[rest]}", None, None)]
        if not rest.startswith("block."):
            raise KeyError(internal)
        return _export_layer(prefix, rest[len("block."):], "upstream", num_experts)
    if parts[0] == "layers":
        return _export_layer(f"layers.{parts[1]}", ".".join(parts[2:]), layout, num_experts)
    for up, hf, inner in _TOP_TABLE:
        if inner == internal:
            return [(up if layout == "upstream" else hf, None, None)]
    raise KeyError(internal)


def _export_layer(prefix: str, suffix: str, layout: str, num_experts: int) -> list[tuple[str, int | None, str | None]]:
    if layout == "transformers":
        hf = {internal: hf for _, hf, internal in _LAYER_TABLE}[suffix]
        return [(f"model.{prefix}.{hf}", None, None)]
    pieces = {internal: [] for internal, _ in EXPERT_PARTS.values()}
    for w, (internal, part) in EXPERT_PARTS.items():
        pieces[internal].append((w, part))
    if suffix in pieces:
        return [(f"{prefix}.ffn.experts.{e}.{w}.weight", e, part)
                for e in range(num_experts) for w, part in pieces[suffix]]
    up = {internal: up for up, _, internal in _LAYER_TABLE if up}[suffix]
    return [(f"{prefix}.{up}", None, None)]
