"""What a model architecture provides to the engine and the server (`Architecture`).

The engine core (scheduler, block manager, KV pools, sampler, worker) and the server never test
an architecture's name: they ask the `Architecture` that `engine.models.registry` maps the
checkpoint's config.json to, for its parts (config parsing, model build and weight loading, the
KV layout and cache class, the step runner, expert-parallel MoE, checkpoint writing) and for its
`Capabilities`. An architecture module subclasses `Architecture`, overrides what differs from
the defaults here, and registers itself (registry.register or the built-in table).

No torch at import: the HTTP process reads configs and capabilities too. Methods that build
models import their implementation when called; this module imports nothing of the engine (the
engine core imports the registry, so the interface must not point back at it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Capabilities:
    """What the engine and the server may rely on for one architecture (read, never name-tested)."""

    # Draft source for --speculative-tokens: 'mtp' (V4's MTP layers: drafts read window rows
    # computed with the token after them), 'dspark' (V4.1's block drafter: windows hold main
    # positions' rows only), or None (no drafter: speculation is refused).
    drafter: str | None = None
    # --async-scheduling: the runner accepts a step's inputs as device-side tokens.
    async_scheduling: bool = False
    # The engine's generic static decode backend (engine/cuda_graphs.py: fixed shapes, CUDA graphs
    # on a GPU, the compiled CPU step) serves this architecture's decode steps.
    generic_static_decode: bool = False
    # The architecture builds its own static decode backend (`Architecture.static_backend`).
    own_static_decode: bool = False
    # --batch-invariant: row-independent numerics (a row's bits do not depend on its batch).
    batch_invariant: bool = False
    # Reference numerics on a CPU (kernels/cpu_precision.py keeps exact fp32 products).
    reference_numerics: bool = False
    # Image input through the multimodal input stage (`Architecture.input_processor`).
    images: bool = False
    # PD disaggregation: the decode side always rebuilds sliding state by replaying the prompt's
    # receptive field (True) rather than receiving the sliding rows (False).
    pd_replays_sliding_state: bool = False
    # The prefix cache's salt names every pool's record format (formats kv_dtype alone does not name).
    salt_names_pool_formats: bool = False


class Architecture:
    """One model architecture. Class attributes describe it; methods supply its parts.

    `name` is what `ModelConfig.arch` holds and what `make-model --arch` / `train-builtin --arch`
    take; `model_types` / `hf_architectures` are the config.json values the registry maps here."""

    name: str = ""
    display_name: str = ""
    model_types: tuple[str, ...] = ()
    hf_architectures: tuple[str, ...] = ()
    chat_family: str = ""  # the chat format family --tokenizer-mode auto picks ("" : none)
    capabilities: Capabilities = Capabilities()

    # ---- config ----------------------------------------------------------------------------
    def parse_config(self, raw: dict[str, Any]):
        """config.json (already JSON-decoded) → the engine's ModelConfig (or the architecture's
        own config object with the fields the engine reads); ConfigError names a bad key."""
        raise NotImplementedError

    # ---- weights -----------------------------------------------------------------------------
    def load_model(self, model_dir: Path, *, dtype, device: str, progress: bool, load_mtp: bool,
                   weight_dtype: str, experts: dict[int, list[int]] | None, engram_tables: str,
                   language_model_only: bool):
        """Build the model and fill it from the checkpoint; `experts`: MoE layer id → the logical
        experts this rank holds under expert parallelism (None: all)."""
        raise NotImplementedError

    def meta_model(self, cfg, source: Path, weight_dtype: str, with_mtp: bool,
                   experts: dict[int, list[int]] | None):
        """The model on the meta device with its stored formats and expert share, for
        `ringserve memory-report` (nothing read but config.json and safetensors headers)."""
        raise NotImplementedError(f"{self.display_name}: memory-report is not supported")

    def write_checkpoint(self, out_dir: str | Path, preset: str, *, seed: int, quantize: str | None,
                         layout: str, dtype: str, vision: bool, **overrides) -> Path:
        """A random-weight checkpoint with a tokenizer (`ringserve make-model --arch NAME`);
        ValueError names an option this architecture does not take."""
        raise NotImplementedError(f"{self.display_name}: make-model is not supported")

    # ---- KV cache and step -------------------------------------------------------------------
    def kv_layout(self, cfg, kv_dtype: str, compute_dtype: str, block_size: int, num_mtp_layers: int | None,
                  index_dtype: str):
        """The KV pools (engine/kv_layout.py KVLayout) of this architecture's layers."""
        raise NotImplementedError

    def cache_class(self):
        """The KV cache class the engine allocates (`for_model(model, ...)`: engine/kv_cache.py
        KVCache or a subclass)."""
        raise NotImplementedError

    def static_backend(self, model, cache, config, max_model_len: int, num_drafts: int):
        """The architecture's own static decode backend (capabilities.own_static_decode), or None."""
        return None

    def runner(self, model, cache, config, num_drafts: int, static):
        """The step runner (engine/model_runner.py ModelRunner or a subclass)."""
        raise NotImplementedError

    def fixed_state(self, cfg, layout) -> list[dict] | None:
        """`kv-report`'s per-sequence state items beyond the pools' windows, or None."""
        return None

    # ---- expert parallelism -------------------------------------------------------------------
    def moe_layer_ids(self, cfg, num_mtp: int) -> list[int]:
        """Placement index of every MoE layer that expert parallelism splits: the backbone's,
        then its draft layers' (an architecture whose drafter stays whole lists the backbone only)."""
        return list(range(cfg.num_layers + num_mtp))

    def expert_parallel_moe(self, model, a2a, moe, maps):
        """The dispatcher that replaces `moe`'s routed part under expert parallelism
        (engine/distributed/ep_moe.py ExpertParallelMoE or a subclass)."""
        raise NotImplementedError(f"{self.display_name}: expert parallelism is not supported")

    # ---- prefix cache ---------------------------------------------------------------------------
    def chained_window_layers(self, cfg, layers: set[int]) -> set[int]:
        """The window-pool layers whose rows feed one another in sequence (the prefix cache's
        receptive field counts them); by default every window layer."""
        return layers

    # ---- multimodal input stage ---------------------------------------------------------------
    def input_processor(self, cfg):
        """The input stage run before tokenization on the HTTP side, or None (text only): an
        object with `preprocess` (media bytes → pixels and the span each item takes in the
        prompt) and `image_token_id`; its encoder (the model's, run by the runner) places its
        outputs into the token stream at those spans. V4.1: engine/v41/vision/frontend.py."""
        return None

    def images_refusal(self, cfg) -> str:
        """Why this model takes no image input, when `input_processor` gives None."""
        return f"this model takes no image input ({self.display_name} is text only)"

    def __repr__(self) -> str:
        return f"<Architecture {self.name}: {self.display_name}>"
