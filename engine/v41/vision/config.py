"""The V4.1 vision tower's geometry and DeepSeek's image resize rules, from the release config.

The release's root `config.json` carries `vision_config` (transformers key names) beside
`text_config`, and `image_token_id` at the root. `num_hidden_layers` 0 (or no `vision_config`)
means a text-only checkpoint. Defaults are those of DeepSeek's reference `ModelArgs`. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"  # the image token's text in DeepSeek's tokenizer
RELEASE_IMAGE_TOKEN_ID = 129264  # its id in the released tokenizer


@dataclass(frozen=True)
class VisionConfig:
    n_layers: int
    dim: int
    n_heads: int
    inter_dim: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int
    max_n_token: int  # an image's whole span (delimiters included) fits in this many positions
    min_pixels: int  # smaller images are scaled up to about this many pixels first
    max_wh_ratio: float | None  # wider images are stretched to this aspect ratio (None: never)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def patch_values(self) -> int:
        """Inputs of the patch embedding: 3 channels × patch × patch."""
        return 3 * self.patch_size ** 2

    @property
    def max_patches(self) -> int:
        """An upper bound on one image's ViT patches under the token budget: its LLM grid has
        fewer than max_n_token cells, each covering downsample² patches."""
        return self.max_n_token * self.downsample_ratio ** 2


def parse_vision(raw: dict[str, Any]) -> VisionConfig | None:
    """The root config's `vision_config` → VisionConfig, None for a text-only checkpoint. Each
    field under its transformers name (`num_hidden_layers`, `max_image_tokens`, …), else REF's
    (`n_layers`, `max_n_token`, …), in `vision_config` or flat at the root as `vision_<name>`
    (REF's ModelArgs); defaults are the release's."""
    from engine.config import ConfigError

    v = raw.get("vision_config") or {}
    if not isinstance(v, dict):
        raise ConfigError("config.json: vision_config must be an object")

    def field(names: tuple[str, ...], default):
        """The first of `names` in vision_config, else REF's flat `vision_<name>` at the root."""
        for name in names:
            if name in v:
                return v[name]
        return next((raw[f"vision_{n}"] for n in names if f"vision_{n}" in raw), default)

    n_layers = int(field(("num_hidden_layers", "n_layers"), 0))
    if n_layers <= 0:
        return None
    ratio = field(("max_wh_ratio",), None)
    cfg = VisionConfig(
        n_layers=n_layers, dim=int(field(("hidden_size", "dim"), 1024)),
        n_heads=int(field(("num_attention_heads", "n_heads"), 16)),
        inter_dim=int(field(("intermediate_size", "inter_dim"), 2816)), patch_size=int(field(("patch_size",), 14)),
        rope_theta=float(field(("rope_theta",), 10000.0)), downsample_ratio=int(field(("downsample_ratio",), 3)),
        max_n_token=int(field(("max_image_tokens", "max_n_token"), 1024)),
        min_pixels=int(field(("min_pixels",), 544 * 544)), max_wh_ratio=None if ratio is None else float(ratio))
    checks = [
        (cfg.dim % cfg.n_heads == 0 and cfg.head_dim % 4 == 0,
         "vision hidden_size / num_attention_heads must be a multiple of 4 (2-D rotary halves)"),
        (cfg.patch_size > 0 and cfg.downsample_ratio > 0, "vision patch_size and downsample_ratio must be > 0"),
        (cfg.max_n_token >= 4, "vision max_image_tokens must be ≥ 4 (one row of one token and its delimiters)"),
        (cfg.min_pixels >= 0, "vision min_pixels must be ≥ 0"),
        (cfg.max_wh_ratio is None or cfg.max_wh_ratio > 0, "vision max_wh_ratio must be > 0 or null"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(f"config.json: {message}")
    return cfg


def image_token_id_of(raw: dict[str, Any]) -> int:
    """The root config's `image_token_id` (the text config's, else the release's)."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    return int(raw.get("image_token_id", text.get("image_token_id", RELEASE_IMAGE_TOKEN_ID)))


def vision_to_release(cfg: VisionConfig) -> dict[str, Any]:
    """The release's `vision_config` object of a VisionConfig (make-model writes it)."""
    return {"model_type": "deepseek_v41_vision", "num_hidden_layers": cfg.n_layers, "hidden_size": cfg.dim,
            "num_attention_heads": cfg.n_heads, "intermediate_size": cfg.inter_dim, "patch_size": cfg.patch_size,
            "rope_theta": cfg.rope_theta, "downsample_ratio": cfg.downsample_ratio,
            "max_image_tokens": cfg.max_n_token, "min_pixels": cfg.min_pixels, "max_wh_ratio": cfg.max_wh_ratio}
