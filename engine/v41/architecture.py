"""DeepSeek-V4.1 as an `Architecture`: its parts live in this package (config, weights, KV
layout and cache, runner, static decode, DSpark, expert-parallel MoE, vision). No torch at
import."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..models.base import Architecture, Capabilities


class DeepSeekV41(Architecture):
    name = "v41"
    display_name = "DeepSeek-V4.1"
    model_types = ("deepseek_v41",)
    hf_architectures = ("DeepseekV41ForCausalLM",)
    chat_family = "deepseek_v41"
    # Async scheduling: its runner takes no device-side tokens yet. Static decode: its own
    # backend (engine/v41/static_decode.py). Images: through the vision tower when the checkpoint has one.
    capabilities = Capabilities(drafter="dspark", own_static_decode=True, batch_invariant=True,
                                reference_numerics=True, images=True, pd_replays_sliding_state=True,
                                salt_names_pool_formats=True)

    def parse_config(self, raw: dict[str, Any]):
        from engine.v41.config import parse_v41

        return parse_v41(raw)

    def load_model(self, model_dir: Path, *, dtype, device, progress, load_mtp, weight_dtype, experts,
                   engram_tables, language_model_only):
        from engine.v41.weights import load_v41  # bf16 activations by definition: `dtype` does not apply

        return load_v41(model_dir, device, progress, load_mtp, weight_dtype, experts, engram_tables,
                        language_model_only)

    def meta_model(self, cfg, source: Path, weight_dtype: str, with_mtp: bool, experts):
        from engine.v41.meta import meta_model

        return meta_model(cfg, source, weight_dtype, with_mtp, experts)

    def write_checkpoint(self, out_dir, preset, *, seed, quantize, layout, dtype, vision, **overrides) -> Path:
        if layout != "upstream" or dtype != "bf16":
            raise ValueError("--arch v41 writes the release format: --layout and --dtype do not apply")
        if overrides:
            raise ValueError(f"preset overrides are for V4 checkpoints, got {sorted(overrides)}")
        from engine.v41.checkpoint import write_v41_checkpoint

        return write_v41_checkpoint(out_dir, preset, seed=seed, quantize=quantize, vision=vision)

    def kv_layout(self, cfg, kv_dtype, compute_dtype, block_size, num_mtp_layers, index_dtype):
        from engine.v41.kv_layout import build_v41_layout

        return build_v41_layout(cfg, kv_dtype, block_size, num_mtp_layers, index_dtype)

    def cache_class(self):
        from engine.v41.kv_cache import V41KVCache

        return V41KVCache

    def static_backend(self, model, cache, config, max_model_len: int, num_drafts: int):
        from engine.v41.static_decode import build_static_backend

        return build_static_backend(model, cache, config, max_model_len, num_drafts)

    def runner(self, model, cache, config, num_drafts: int, static):
        from engine.v41.runner import V41ModelRunner

        return V41ModelRunner(model, cache, num_drafts, config.decoder_tail, static)

    def fixed_state(self, cfg, layout) -> list[dict] | None:
        from engine.v41.state_report import fixed_state

        return fixed_state(cfg, layout)

    def moe_layer_ids(self, cfg, num_mtp: int) -> list[int]:
        # the DSpark stages (fewer experts each) stay whole on every rank: drafting runs no
        # collective and the placement has one expert count
        return list(range(cfg.num_layers))

    def expert_parallel_moe(self, model, a2a, moe, maps):
        from engine.v41.expert_parallel import V41ExpertParallelMoE  # routing weight before w2, fp32 sums

        return V41ExpertParallelMoE(a2a, moe.experts, *maps)

    def chained_window_layers(self, cfg, layers: set[int]) -> set[int]:
        # DSpark stages (window layers num_layers + s) write rows from the backbone's attention
        # inputs at the same position only: they add no depth (engine/prefix_cache.py)
        return {layer for layer in layers if layer < cfg.num_layers}

    def input_processor(self, cfg):
        from engine.v41.vision.frontend import VisionFrontend

        return VisionFrontend.from_config(cfg)

    def images_refusal(self, cfg) -> str:
        return "this model takes no image input (its checkpoint has no vision tower)"


ARCHITECTURE = DeepSeekV41()
