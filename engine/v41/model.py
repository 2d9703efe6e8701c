"""The DeepSeek-V4.1 model: embedding → hc residual streams → blocks (Engram on its layers) →
collapse with the last FFN pre → norm → head; plus the DSpark stages (engine/v41/dspark.py).

A forward takes a step's chunks (`Chunk`: any mix of prefill chunks, decodes and
verifications, each at its own positions) flattened into one row set. mHC uses the *delayed*
pre: a block's attention input collapses the stream with the previous FFN site's pre (a one-hot
on stream 0 for layer 0), its FFN input with its own attention site's pre, and the model end
with the last FFN site's pre (no hc_head). The residual stream is bf16.

Under reference numerics (engine/v41/numerics.py) every operation whose bits depend on how many
rows share a call — the fp32 GEMMs, sigmoid / softplus / silu — runs per chunk (`per_chunk`), so
each sequence gets exactly what a forward of its chunk alone gives, whatever the batch.

With `tail_rows` (decoder-tail bounded replay, `--decoder-tail approx`) the layers after the
last KV source run only on each chunk's last `tail_rows` tokens: the sources have written the
global KV of every token by then, and those rows are all a later step reads of the tail's
window KV (an approximation: their window attention misses the dropped rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import numerics as nx
from .attention import Attention, Chunk
from .engram import EngramHasher, build_token_map, load_token_map
from .linear import Param, QLinear
from .moe import MoE
from .vision.encoder import ImageEncoder
from .vision.placement import StepImages


def per_chunk(fn, chunks: list[Chunk], *tensors: torch.Tensor):
    """fn over each chunk's rows then concatenated (reference numerics), or over all rows at once
    (row-independent numerics, where it makes no difference). fn returns a tensor or a tuple."""
    if nx.current().row_independent or len(chunks) == 1:
        return fn(*tensors)
    parts = [fn(*(t[c.rows] for t in tensors)) for c in chunks]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(p) for p in zip(*parts))
    return torch.cat(parts)


class HyperSite(nn.Module):
    """fn / base / scale of one mHC site, stored as the release names them on the block."""

    @staticmethod
    def mixes(stream: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, cfg):
        """stream [T, hc, D] → (pre, post, comb): RMS over the flattened hc·D in fp32 with
        rms_norm_eps (not hc_eps), the fp32 GEMM with fn, then split_sinkhorn."""
        xf = stream.flatten(1).float()
        m = nx.fp32_gemm(xf, fn) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + cfg.rms_norm_eps)
        return nx.split_sinkhorn(m, scale, base, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)


class Block(nn.Module):
    """One decoder block (or DSpark stage body): attention and MoE sites with delayed-pre mHC."""

    def __init__(self, cfg, layer: int, n_experts: int, topk: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        n, d = cfg.hc_mult, cfg.hidden_size
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.empty((2 + n) * n, n * d), requires_grad=False))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.empty((2 + n) * n), requires_grad=False))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.empty(3), requires_grad=False))
        self.attn_norm, self.ffn_norm = Param(d), Param(d)
        self.attn = Attention(cfg, layer)
        self.ffn = MoE(cfg, n_experts, topk)

    def site(self, name: str, stream: torch.Tensor, chunks: list[Chunk]):
        fn, base, scale = (getattr(self, f"hc_{name}_{k}") for k in ("fn", "base", "scale"))
        return per_chunk(lambda s: HyperSite.mixes(s, fn, scale, base, self.cfg), chunks, stream)

    def forward(self, stream: torch.Tensor, pre_mix: torch.Tensor, attend, chunks: list[Chunk], ffn=None,
                image_mask: torch.Tensor | None = None):
        """stream [T, hc, D], pre_mix [T, hc] (the previous FFN site's pre) → (stream, this FFN
        site's pre). `attend(x [T, D]) -> [T, D]` is the attention of this block; `ffn(x)`, when
        given, replaces the MoE call (the static decode step's MoE, engine/v41/static_moe.py).
        `image_mask` [T] bool: image-span rows, routed with the gate's `bias_vl`."""
        eps = self.cfg.rms_norm_eps
        attn_pre, attn_post, attn_comb = self.site("attn", stream, chunks)
        x = nx.rms_norm(nx.hc_collapse(stream, pre_mix), self.attn_norm.weight, eps)
        stream = nx.hc_expand(attend(x), stream, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = self.site("ffn", stream, chunks)
        x = nx.rms_norm(nx.hc_collapse(stream, attn_pre), self.ffn_norm.weight, eps)
        if ffn is not None:
            y = ffn(x)
        elif self.ffn.parallel is not None:  # expert parallel: the whole step through one dispatch
            y = self.ffn.forward_parallel(x, lambda fn, *t: per_chunk(fn, chunks, *t), image_mask)
        elif image_mask is not None:
            y = per_chunk(self.ffn, chunks, x, image_mask)
        else:
            y = per_chunk(self.ffn, chunks, x)
        return nx.hc_expand(y, stream, ffn_post, ffn_comb), ffn_pre


def identity_pre(t: int, hc: int, device) -> torch.Tensor:
    """The collapse before any site has spoken: all weight on stream 0. [T, hc] fp32."""
    pre = torch.zeros(t, hc, device=device)
    pre[:, 0] = 1.0
    return pre


class Engram(nn.Module):
    """An Engram layer: hashed n-gram rows → wkv → a key per stream and one shared value; each
    stream gets σ(signed √ of its normalised ⟨H_k, q⊙k_w⊙key_k⟩) times the value, in fp32."""

    GATE_FLOOR = 1e-6

    def __init__(self, cfg, rows: int):
        super().__init__()
        v, n, d = cfg.v41, cfg.hc_mult, cfg.hidden_size
        self.cfg = cfg
        self.embed = QLinear(v.engram_head_dim, rows)  # FP8 with one E8M0 scale per row per 32
        self.wkv = QLinear(v.engram_n_hash_cols * v.engram_head_dim, (n + 1) * d)
        self.q_weight = nn.Parameter(torch.empty(n, d, dtype=torch.bfloat16), requires_grad=False)
        self.k_weight = nn.Parameter(torch.empty(n, d, dtype=torch.bfloat16), requires_grad=False)

    def lookup(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """[T, cols] row ids → bf16 rows [T, cols, head_dim] (dequantized on lookup) on the
        device of wkv. The gather runs where the table lives: with the tables in host memory
        (`--engram-tables host`) only the rows read cross to the device."""
        rows = self._gather(hash_ids.to(self.embed.weight.device))
        return rows.to(self.wkv.weight.device, non_blocking=True)

    def _gather(self, hash_ids: torch.Tensor) -> torch.Tensor:
        e = self.embed
        if not e.fmt.quantized:
            return e.weight[hash_ids].to(torch.bfloat16)
        codes = e.weight.view(torch.uint8)[hash_ids].view(torch.float8_e4m3fn).float()  # [T, cols, head_dim]
        scale = e.scale[hash_ids].view(torch.uint8)
        values = torch.ldexp(torch.ones(scale.shape, device=scale.device), scale.to(torch.int32) - 127)
        values = torch.where(scale == 255, float("nan"), values)  # [T, cols, head_dim / block]
        values = values[..., None].expand(*values.shape, e.fmt.block[1]).flatten(-2)  # each scale over its block
        rows = (codes * values).to(torch.bfloat16)
        return rows.pin_memory() if rows.device.type == "cpu" and torch.cuda.is_available() else rows

    def forward(self, stream: torch.Tensor, hash_ids: torch.Tensor, chunks: list[Chunk],
                dead: torch.Tensor | None = None) -> torch.Tensor:
        return self.mix(stream, self.lookup(hash_ids), chunks, dead)

    def mix(self, stream: torch.Tensor, rows: torch.Tensor, chunks: list[Chunk],
            dead: torch.Tensor | None = None) -> torch.Tensor:
        """stream [T, hc, D] bf16 and the looked-up table rows [T, cols, head_dim] → the new stream.
        `dead` [T] bool: image-span rows, whose gates are shut (they pass through unchanged)."""
        cfg = self.cfg
        n, d = cfg.hc_mult, cfg.hidden_size
        kv = self.wkv(rows.flatten(1))  # [T, (hc + 1)·dim] bf16
        key, value = kv.split([n * d, d], dim=-1)
        key = key.float().unflatten(-1, (n, d))
        weight = self.q_weight.float() * self.k_weight.float()  # [hc, dim]
        h, eps = stream.float(), cfg.rms_norm_eps
        rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)  # [T, hc]
        dot = (h * weight * key).sum(-1) * rstd * d**-0.5
        signed = torch.copysign(dot.abs().clamp_min(self.GATE_FLOOR).sqrt(), dot)
        gate = per_chunk(nx.sigmoid, chunks, signed)
        if dead is not None:
            gate = gate.masked_fill(dead[:, None], 0.0)
        return (h + gate[..., None] * value.float()[:, None, :]).to(torch.bfloat16)


@dataclass
class ForwardOut:
    x: torch.Tensor  # [R, dim] bf16: the final normed rows (R = rows kept; all unless the tail was cut)
    main_hidden: torch.Tensor | None  # [R, n_targets·dim] bf16: hc-mean attention inputs of the DSpark targets
    kept: torch.Tensor | None  # [R] rows of the step the outputs stand for; None = all rows
    chunks: list[Chunk]  # the chunks as the last layer saw them (positions of the kept rows)


class V41Model(nn.Module):
    def __init__(self, cfg, with_encoder: bool = True):
        """`with_encoder`: build the vision tower when the checkpoint has one (False: the
        language model only, as vLLM's --language-model-only)."""
        super().__init__()
        self.cfg = cfg
        v = cfg.v41
        self.embed = Param(cfg.vocab_size, cfg.hidden_size)
        # The image encoder (ViT + aligner + span vectors); None for a text-only model.
        self.encoder = (ImageEncoder(v.vision, cfg.hidden_size, v.image_token_id)
                        if v.vision is not None and with_encoder else None)
        self.encoder_skipped = v.vision is not None and not with_encoder  # --language-model-only
        self.layers = nn.ModuleList(Block(cfg, i, cfg.n_routed_experts, cfg.num_experts_per_tok)
                                    for i in range(cfg.num_layers))
        for slot, layer in enumerate(v.engram_layer_ids):
            self.layers[layer].engram = Engram(cfg, v.engram_num_embeddings[slot])
        self.norm = Param(cfg.hidden_size)
        self.head = Param(cfg.vocab_size, cfg.hidden_size, dtype=torch.float32)  # REF holds the head in fp32
        self.mtp: nn.ModuleList = nn.ModuleList()  # DSpark stages, filled by the loader when wanted
        self.numerics = nx.Numerics()
        self.tail_rows: int | None = None  # decoder-tail bounded replay (None: exact)
        self.hasher: EngramHasher | None = None
        self.layers_run = 0  # read by the worker's heartbeat

    # ---- after loading ----------------------------------------------------------------------
    def prepare(self, model_dir: Path | None = None, token_map: list[int] | None = None) -> None:
        """Rope tables and the Engram hasher (its token map from engram_token_map.json, else
        rebuilt from tokenizer.json)."""
        cfg = self.cfg
        self.freqs_main = nx.rope_freqs(cfg.rope_dim, cfg.rope_theta, None).to(self.device)
        self.freqs_compress = nx.rope_freqs(cfg.rope_dim, cfg.compress_rope_theta, cfg.yarn).to(self.device)
        if cfg.v41.engram_layer_ids:
            if token_map is None and model_dir is not None:
                loaded = load_token_map(model_dir)
                if loaded is None and (Path(model_dir) / "tokenizer.json").exists():
                    loaded = build_token_map(Path(model_dir) / "tokenizer.json")
                if loaded is None:
                    raise ValueError(f"{model_dir}: Engram needs engram_token_map.json or tokenizer.json")
                if loaded[1] != cfg.v41.engram_compressed_vocab_size:
                    raise ValueError(f"{model_dir}: the Engram token map has {loaded[1]} compressed ids, the "
                                     f"config says {cfg.v41.engram_compressed_vocab_size}")
                token_map = loaded[0]
            if token_map is None:
                raise ValueError("Engram needs a token map")
            self.hasher = EngramHasher(cfg, token_map)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16  # V4.1's activations are bf16 by definition

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def freqs_of(self, layer: int) -> torch.Tensor:
        """Window-only layers and DSpark stages: rope_theta, no YaRN; ratio > 0 layers:
        compress_rope_theta with YaRN (queries, window keys, entries and index q/k alike)."""
        ratio = self.cfg.compress_ratios[layer] if layer < self.cfg.num_layers else 0
        return self.freqs_compress if ratio else self.freqs_main

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, token_ids: torch.Tensor, chunks: list[Chunk], host_ids: torch.Tensor | None = None,
                images: StepImages | None = None) -> ForwardOut:
        """token_ids [T] on the device; `host_ids`: the same on the host when the caller has them
        (Engram hashes them there; otherwise they are read back). `images`: the rows that are
        image-span positions and their embeddings (engine/v41/vision/placement.py)."""
        with nx.numerics(self.numerics):
            return self._forward(token_ids, chunks, token_ids.cpu() if host_ids is None else host_ids, images)

    def _hash_ids(self, host_ids: torch.Tensor, chunks: list[Chunk],
                  dead: torch.Tensor | None = None) -> torch.Tensor | None:
        """[T, n_engram_layers, cols] hash ids on the host (each Engram layer moves its column to
        its table); records each chunk's compressed ids by position (DEAD at image positions)."""
        if self.hasher is None:
            return None
        return torch.cat([self.hasher.step_ids(c.seq.engram, c.start, host_ids[c.rows],
                                               dead[c.rows] if dead is not None else None) for c in chunks])

    def embed_rows(self, token_ids: torch.Tensor, images: StepImages | None) -> torch.Tensor:
        """[T, dim] bf16: the token embeddings, image-span rows overwritten by their images'."""
        x = self.embed.weight[token_ids]
        if images is not None:
            x[images.rows] = images.embeds
        return x

    def _forward(self, token_ids: torch.Tensor, chunks: list[Chunk], host_ids: torch.Tensor,
                 images: StepImages | None = None) -> ForwardOut:
        cfg, v = self.cfg, self.cfg.v41
        device = self.device
        hashes = self._hash_ids(host_ids, chunks, images.host_mask if images is not None else None)
        positions = torch.cat([torch.arange(c.start, c.end, device=device) for c in chunks])
        stream = self.embed_rows(token_ids, images)[:, None, :].repeat(1, cfg.hc_mult, 1)  # [T, hc, dim]
        pre_mix = identity_pre(token_ids.shape[0], cfg.hc_mult, device)
        targets, kept = {}, None
        for i, block in enumerate(self.layers):
            mask = images.mask if images is not None else None
            if getattr(block, "engram", None) is not None:
                stream = block.engram(stream, hashes[:, v.engram_layer_ids.index(i)], chunks, mask)
            if i in v.dspark_target_layer_ids:  # DSpark reads the attention input
                targets[i] = (stream.mean(dim=1), kept)
            freqs = self.freqs_of(i)
            rot = nx.rotation(positions, freqs)

            def attend(x, block=block, rot=rot, freqs=freqs, positions=positions, chunks=chunks):
                return block.attn(x, positions, rot, chunks, freqs)

            stream, pre_mix = block(stream, pre_mix, attend, chunks, image_mask=mask)
            self.layers_run += 1
            if self.tail_rows is not None and i == v.tail_start:
                sel = self._tail_selection(chunks)
                if sel is not None:
                    rows, chunks = sel
                    stream, pre_mix, positions = stream[rows], pre_mix[rows], positions[rows]
                    hashes = hashes[rows] if hashes is not None else None
                    images = images.kept(rows) if images is not None else None
                    kept = rows if kept is None else kept[rows]
        x = nx.rms_norm(nx.hc_collapse(stream, pre_mix), self.norm.weight, cfg.rms_norm_eps)
        main = None
        if targets:
            parts = []
            for layer in v.dspark_target_layer_ids:
                h, at = targets[layer]
                parts.append(h if at is kept else h[self._relative(kept, at)])
            main = torch.cat(parts, dim=-1)
        return ForwardOut(x, main, kept, chunks)

    @staticmethod
    def _relative(kept: torch.Tensor, at: torch.Tensor | None) -> torch.Tensor:
        """Positions within rows `at` of the rows `kept` (both subsets of the step's rows)."""
        return kept if at is None else torch.searchsorted(at, kept)

    def _tail_selection(self, chunks: list[Chunk]):
        """(rows to keep, chunks over them) when some prefill chunk is longer than tail_rows."""
        if all(c.length <= self.tail_rows for c in chunks):
            return None
        rows, out, begin = [], [], 0
        for c in chunks:
            keep = min(c.length, self.tail_rows)
            rows.append(torch.arange(c.begin + c.length - keep, c.begin + c.length))
            handoff = {k: t[c.length - keep:] for k, t in c.handoff.items()}  # per-row selections
            floor = c.end - keep if keep < c.length else c.window_floor  # rows below: not computed here
            out.append(Chunk(c.seq, c.end - keep, begin, keep, handoff, c.trace, floor))
            begin += keep
        return torch.cat(rows).to(self.device), out

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[R, dim] → fp32 [R, V]; the head runs on one row at a time (REF computes the last row
        alone, and fp32 GEMM bits depend on the row count)."""
        with nx.numerics(self.numerics):
            return torch.cat([nx.fp32_gemm(x[i:i + 1], self.head.weight) for i in range(x.shape[0])])
