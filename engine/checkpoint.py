"""Writing checkpoints in the release formats, for every architecture's `make-model`: FP8 e4m3
with ue8m0 block scales, FP4 e2m1 packed two per byte with a ue8m0 scale per group along K, and
safetensors shards with their index. DeepSeek-V4's writer: engine/v4/checkpoint.py; V4.1's:
engine/v41/checkpoint.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


# ---- quantization ------------------------------------------------------------------------

_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _ue8m0(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Power-of-two scale ≥ amax / qmax (all-zero blocks get 1)."""
    ratio = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return torch.exp2(torch.ceil(torch.log2(ratio)))


def quantize_fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, C] → (e4m3 [R, C], ue8m0 scales [R/block, C/block])."""
    r, c = w.shape
    tiles = w.view(r // block, block, c // block, block)
    scale = _ue8m0(tiles.abs().amax(dim=(1, 3)), 448.0)  # [R/b, C/b]
    q = (tiles / scale[:, None, :, None]).view(r, c).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round |x| ≤ 6 to the nearest e2m1 code, ties to the even code; sign in bit 3."""
    mag = x.abs()
    midpoints = ((_E2M1_GRID[1:] + _E2M1_GRID[:-1]) / 2).to(x.device)
    code = torch.bucketize(mag, midpoints, right=False)  # ties land on the lower code
    at_tie = (code < 7) & (mag == midpoints[code.clamp(max=6)]) & (code % 2 == 1)
    code = code + at_tie.long()
    return (code | ((x < 0).long() << 3)).to(torch.uint8)


def quantize_fp4_rows(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, C] → (int8 [R, C/2] packed e2m1, low nibble = even column; ue8m0 [R, C/group])."""
    r, c = w.shape
    groups = w.view(r, c // group, group)
    scale = _ue8m0(groups.abs().amax(dim=-1), 6.0)  # [R, C/group]
    codes = e2m1_codes((groups / scale[..., None]).clamp(-6, 6)).view(r, c)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


# ---- writing -----------------------------------------------------------------------------


def write_shards(out_dir: Path, tensors: dict[str, torch.Tensor], shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
