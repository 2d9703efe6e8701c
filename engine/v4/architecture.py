"""DeepSeek-V4 as an `Architecture`: its parts are this package's (config.py `parse_v4`,
weights.py `load_v4`, kv_layout.py `build_v4_layout`, checkpoint.py for make-model) and the
engine core's KV cache and model runner (engine/kv_cache.py, engine/model_runner.py).
No torch at import."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..models.base import Architecture, Capabilities


class DeepSeekV4(Architecture):
    name = "v4"
    display_name = "DeepSeek-V4"
    model_types = ("deepseek_v4",)
    hf_architectures = ("DeepseekV4ForCausalLM",)
    chat_family = "deepseek_v4"
    capabilities = Capabilities(drafter="mtp", async_scheduling=True, generic_static_decode=True)

    def parse_config(self, raw: dict[str, Any]):
        from engine.v4.config import parse_v4

        return parse_v4(raw)

    def load_model(self, model_dir: Path, *, dtype, device, progress, load_mtp, weight_dtype, experts,
                   engram_tables, language_model_only):
        from engine.v4.weights import load_v4

        return load_v4(model_dir, dtype, device, progress, load_mtp, weight_dtype, experts)

    def meta_model(self, cfg, source: Path, weight_dtype: str, with_mtp: bool, experts):
        import torch

        from engine.v4.weight_formats import formats_from_config
        from engine.v4.weights import build_model, checkpoint_formats, configure

        model = build_model(cfg, with_mtp, dtype=torch.bfloat16)
        formats = {}
        if weight_dtype != "bf16":
            formats = (checkpoint_formats(source, model) if source.is_dir() and any(source.glob("*.safetensors"))
                       else formats_from_config(model, cfg))
        configure(model, formats, experts)
        return model

    def write_checkpoint(self, out_dir, preset, *, seed, quantize, layout, dtype, vision, **overrides) -> Path:
        if vision:
            raise ValueError("--vision needs --arch v41 (DeepSeek-V4 has no vision tower)")
        import torch

        from engine.v4.checkpoint import preset_config, random_state, write_checkpoint
        from tokenization.synthetic_bpe import write_tokenizer

        cfg = preset_config(preset, **overrides)
        torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        out = write_checkpoint(out_dir, cfg, random_state(cfg, seed), layout=layout, dtype=torch_dtype,
                               quantize=quantize)
        write_tokenizer(out, cfg.vocab_size)
        return out

    def kv_layout(self, cfg, kv_dtype, compute_dtype, block_size, num_mtp_layers, index_dtype):
        from engine.v4.kv_layout import build_v4_layout

        return build_v4_layout(cfg, kv_dtype, compute_dtype, block_size, num_mtp_layers, index_dtype)

    def cache_class(self):
        from engine.kv_cache import KVCache

        return KVCache

    def runner(self, model, cache, config, num_drafts: int, static):
        from engine.model_runner import ModelRunner

        return ModelRunner(model, cache, num_drafts, static)

    def expert_parallel_moe(self, model, a2a, moe, maps):
        from engine.distributed.ep_moe import ExpertParallelMoE

        return ExpertParallelMoE(a2a, moe.experts.local_experts, *maps)


ARCHITECTURE = DeepSeekV4()
