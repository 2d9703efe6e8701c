"""Configuration: the model's (`ModelConfig`, read from a Hugging Face `config.json`) and the
engine's (`EngineConfig`, built from CLI flags or the offline API). Neither imports torch, so the
HTTP process can read them without loading the engine.

The architecture a config.json names (engine/models/registry.py) parses it into `ModelConfig`:
DeepSeek-V4's two dialects in engine/v4/config.py, V4.1's in engine/v41/config.py.
`ModelConfig` writes V4's dialects back (`to_transformers_dict`, `to_upstream_dict`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from engine.kv_transfer.config import KVTransferConfig  # PD disaggregation (msgspec only)

from .models import registry  # config.json → the architecture that parses it

LAYER_TYPE_TO_KIND = {
    "sliding_attention": "swa",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
_KIND_TO_LAYER_TYPE = {v: k for k, v in LAYER_TYPE_TO_KIND.items()}


class ConfigError(ValueError):
    """A config.json that ringserve cannot serve; the message names the offending key."""


@dataclass(frozen=True)
class YarnParams:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    # Per layer compress ratio: 0 = sliding window only, m > 0 = compressed branch every m tokens.
    compress_ratios: tuple[int, ...]
    # Per layer: 'swa', 'csa' (overlapping compressor + lightning indexer) or 'hca' (plain compressor).
    layer_kinds: tuple[str, ...]
    # Per layer: True = hash routing (tid2eid) instead of learned top-k.
    hash_layers: tuple[bool, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    scoring_func: str
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnParams | None
    max_position_embeddings: int
    num_nextn_predict_layers: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool = False
    quantization: dict[str, Any] | None = field(default=None, compare=False)
    # 'v4' (DeepSeek-V4) or 'v41' (DeepSeek-V4.1: `v41` holds what it adds; engine/v41/config.py)
    arch: str = "v4"
    v41: Any = None

    # ---- derived -------------------------------------------------------------------------
    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    def layer_kind(self, layer: int) -> str:
        return self.layer_kinds[layer]

    def _ratios_of(self, kind: str) -> list[int]:
        return sorted({r for r, k in zip(self.compress_ratios, self.layer_kinds) if k == kind})

    @property
    def csa_ratio(self) -> int:
        return (self._ratios_of("csa") or [4])[0]

    @property
    def hca_ratio(self) -> int:
        return (self._ratios_of("hca") or [128])[0]

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        return _parse(raw)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_path = path / "config.json" if path.is_dir() else path
        if not cfg_path.exists():
            raise ConfigError(f"no config.json at {cfg_path}")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{cfg_path}: not valid JSON ({exc})") from None
        return _parse(raw)

    def to_transformers_dict(self) -> dict[str, Any]:
        """The transformers dialect of this config (what `DeepseekV4Config` reads natively)."""
        if len(self._ratios_of("csa")) > 1 or len(self._ratios_of("hca")) > 1:
            raise ConfigError("transformers supports one compress rate per attention type")
        rates = {"compressed_sparse_attention": self.csa_ratio, "heavily_compressed_attention": self.hca_ratio}
        compress_rope: dict[str, Any] = {"rope_type": "default"}
        if self.yarn is not None:
            compress_rope = {
                "rope_type": "yarn",
                "factor": self.yarn.factor,
                "original_max_position_embeddings": self.yarn.original_max_position_embeddings,
                "beta_fast": self.yarn.beta_fast,
                "beta_slow": self.yarn.beta_slow,
                "attention_factor": 1.0,
            }
        partial = self.rope_dim / self.head_dim
        compress_rope.update(rope_theta=self.compress_rope_theta, partial_rotary_factor=partial)
        out = {
            "model_type": "deepseek_v4",
            "architectures": ["DeepseekV4ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "partial_rotary_factor": partial,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "layer_types": [_KIND_TO_LAYER_TYPE[k] for k in self.layer_kinds],
            "compress_rates": rates,
            "mlp_layer_types": ["hash_moe" if h else "moe" for h in self.hash_layers],
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "scoring_func": self.scoring_func,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": partial},
                "compress": compress_rope,
            },
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids),
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "bfloat16",
        }
        if self.quantization:
            out["quantization_config"] = dict(self.quantization)
        return out

    def to_upstream_dict(self) -> dict[str, Any]:
        """The upstream dialect (legacy keys, as in released checkpoints)."""
        out = self.to_transformers_dict()
        for key in ("layer_types", "compress_rates", "mlp_layer_types", "rope_parameters", "partial_rotary_factor"):
            out.pop(key)
        out["num_hash_layers"] = sum(self.hash_layers)
        out["qk_rope_head_dim"] = self.rope_dim
        legacy = {"swa": 0, "csa": 4, "hca": 128}
        out["compress_ratios"] = [legacy[k] for k in self.layer_kinds] + [0] * self.num_nextn_predict_layers
        # The legacy per-layer list only knows 0/4/128; scalar overrides carry other rates.
        if self.csa_ratio != 4:
            out["compress_rate_csa"] = self.csa_ratio
        if self.hca_ratio != 128:
            out["compress_rate_hca"] = self.hca_ratio
        if self.yarn is not None:
            out["rope_scaling"] = {
                "type": "yarn",
                "factor": self.yarn.factor,
                "original_max_position_embeddings": self.yarn.original_max_position_embeddings,
                "beta_fast": self.yarn.beta_fast,
                "beta_slow": self.yarn.beta_slow,
            }
        return out

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)


def _parse(raw: dict[str, Any]) -> ModelConfig:
    """The registered architecture that serves this config.json parses it (engine/models/registry.py)."""
    arch = registry.for_config(raw)
    if arch is None:
        raise ConfigError(f"config.json: unsupported model_type {raw.get('model_type')!r}; ringserve serves "
                          f"{', '.join(registry.served_model_types())}")
    return arch.parse_config(raw)


# ---- the engine's configuration --------------------------------------------------------------

MODES = ("throughput", "single-user")
COMPUTE_DTYPES = ("auto", "bf16", "fp32")
KV_DTYPES = ("auto", "bf16", "fp8", "fp4")
WEIGHT_DTYPES = ("auto", "bf16")
CPU_MATMUL_PRECISIONS = ("auto", "fp32", "bf16")  # kernels/cpu_precision.py
ENGRAM_TABLES = ("device", "host")
PREFIX_REPLAY_MODES = ("exact", "bounded")


@dataclass(frozen=True)
class EngineConfig:
    """One device's engine. `None` fields take the mode's default (see `resolved`). It reaches a
    worker process as JSON (`to_json` / `from_json`), typed and checked on the way in."""

    mode: str = "throughput"
    dtype: str = "auto"  # compute dtype: auto = fp32 on CPU, bf16 on GPU
    kv_dtype: str = "auto"  # auto = the compute dtype (exact); bf16 | fp8 | fp4
    # auto = weights as the checkpoint stores them (FP8/FP4 dequantized inside the GEMMs);
    # bf16 = every weight decoded into the compute dtype at load.
    weight_dtype: str = "auto"
    # fp32 matmuls of a CPU worker: exact, or bf16 operands with fp32 accumulation (oneDNN; auto
    # = bf16 on CPUs with AMX or AVX512-BF16). kernels/cpu_precision.py.
    cpu_matmul_precision: str = "auto"
    # DeepSeek-V4.1's Engram tables (hashed n-gram rows, 189 GiB in the release): on the device,
    # or in host memory, looked up there and only the rows a step reads copied over.
    engram_tables: str = "device"
    # vLLM's --language-model-only: a checkpoint with a vision tower (DeepSeek-V4.1) loads without
    # it (its tensors are not read) and refuses image input.
    language_model_only: bool = False
    # vLLM's batch invariance: a token's result never depends on what shares its step, so greedy
    # output with speculation equals greedy output without, bit for bit (DeepSeek-V4.1: its
    # row-independent numerics, engine/v41/numerics.py; slower).
    batch_invariant: bool = False
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None = min(model max, 32768)
    speculative_tokens: int | None = None
    kv_cache_memory_bytes: int = 2 << 30
    num_kv_blocks: int | None = None  # overrides the memory budget for the growable (full) pools
    block_size: int = 256
    cuda_graph_sizes: tuple[int, ...] = ()
    # Static-shape decode/verify steps (captured as CUDA graphs on GPU, fused numba kernels on
    # CPU). None = the default: on unless enforce_eager — V4.1 on CUDA only (on a CPU its eager
    # path reproduces the reference's tie choices; engine/v41/static_decode.py).
    static_decode: bool | None = None
    enforce_eager: bool = False  # never capture CUDA graphs (a static path, if on, runs uncaptured)
    # Verify only as many of the k drafts as pay for themselves (engine/spec_control.py).
    adaptive_speculation: bool = True
    # vLLM's async scheduling: step t + 1 is scheduled and launched before step t is read back,
    # so the host's update/schedule work overlaps the device's step (engine/engine.py
    # `_step_ahead`), MTP speculation included (on the static decode path). Off where a step's
    # inputs need its predecessor's results on the host: V4.1, PD roles, expert-parallel lockstep.
    async_scheduling: bool = False
    # CPU: greedy decode steps one compiled call may run (kernels/cpu_step.py `greedy_steps`), each
    # step's token the argmax of the one before, as vLLM's multi-step scheduling runs several
    # steps per schedule: the engine's Python per step is paid once per call. Plain greedy
    # requests only (no penalties, logprobs or grammar), without speculation or async
    # scheduling; the call stops at a request's stop id, so output is unchanged, and a stream
    # gets up to this many tokens at a time. A call runs as many as fit ~20 ms (engine/engine.py
    # CALL_BUDGET_S: arrivals wait for it). 1 = one step per call.
    cpu_decode_steps: int = 4
    seed: int = 0
    # --- PD disaggregation (engine/kv_connector.py): this engine's KV role and transport ---
    kv_transfer: KVTransferConfig | None = None
    # DeepSeek-V4.1 prefill: 'exact', or 'approx' = decoder-tail bounded replay (the layers after
    # the last KV source run on each prefill chunk's last `sliding_window` tokens only).
    decoder_tail: str = "exact"
    # Prefix caching (engine/prefix_cache.py): reuse the global KV blocks of a cached prefix.
    # exact = output identical to a cold run (sliding-state snapshots, else a receptive-field
    # replay); bounded = vLLM's approximation (recompute the last window before the hit).
    enable_prefix_caching: bool = True
    prefix_replay: str = "exact"
    prefix_snapshots: int | None = None  # sliding-state snapshots kept (exact mode); None = 4 × max_num_seqs

    def __post_init__(self) -> None:
        checks = [
            (self.mode in MODES, "mode", f"must be one of {', '.join(MODES)}"),
            (self.dtype in COMPUTE_DTYPES, "dtype", f"must be one of {', '.join(COMPUTE_DTYPES)}"),
            (self.kv_dtype in KV_DTYPES, "kv_dtype", f"must be one of {', '.join(KV_DTYPES)}"),
            (self.weight_dtype in WEIGHT_DTYPES, "weight_dtype", f"must be one of {', '.join(WEIGHT_DTYPES)}"),
            (self.cpu_matmul_precision in CPU_MATMUL_PRECISIONS, "cpu_matmul_precision",
             f"must be one of {', '.join(CPU_MATMUL_PRECISIONS)}"),
            (not (self.batch_invariant and self.cpu_matmul_precision == "bf16"), "cpu_matmul_precision",
             "must be auto or fp32 with --batch-invariant (with bf16 a product's path depends on the step's row count)"),
            (self.engram_tables in ENGRAM_TABLES, "engram_tables", f"must be one of {', '.join(ENGRAM_TABLES)}"),
            (all(s >= 1 for s in self.cuda_graph_sizes), "cuda_graph_sizes", "must be positive batch sizes"),
            (self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs", "must be ≥ 1"),
            (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
             "must be ≥ 1"),
            (self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be ≥ 2"),
            (self.speculative_tokens is None or 0 <= self.speculative_tokens <= 8, "speculative_tokens",
             "must be in [0, 8]"),
            (self.block_size >= 1, "block_size", "must be ≥ 1"),
            (1 <= self.cpu_decode_steps <= 64, "cpu_decode_steps", "must be in [1, 64]"),
            (self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes", "must be positive"),
            (self.decoder_tail in ("exact", "approx"), "decoder_tail", "must be exact or approx"),
            (self.prefix_replay in PREFIX_REPLAY_MODES, "prefix_replay", f"must be one of {', '.join(PREFIX_REPLAY_MODES)}"),
            (self.prefix_snapshots is None or self.prefix_snapshots >= 0, "prefix_snapshots", "must be ≥ 0"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ConfigError(f"--{name.replace('_', '-')} {rule}, got {getattr(self, name)!r}")

    def resolved(self) -> "EngineConfig":
        """Fill the mode-dependent defaults."""
        single = self.mode == "single-user"
        defaults = {
            "max_num_seqs": 4 if single else 64,
            "max_num_batched_tokens": 1024 if single else 2048,
            "speculative_tokens": 3 if single else 0,
            "cuda_graph_sizes": (1, 2, 4) if single else (1, 2, 4, 8, 16, 32, 64),
        }
        values = {k: (getattr(self, k) if getattr(self, k) not in (None, ()) else v) for k, v in defaults.items()}
        if single and values["max_num_seqs"] > 4:
            raise ConfigError("--mode single-user runs at most 4 sequences")
        return replace(self, **values)

    def context_length(self, model: ModelConfig) -> int:
        """Tokens one sequence may hold: --max-model-len, or min(the model's, 32768)."""
        return self.max_model_len or min(model.max_position_embeddings, 32768)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> "EngineConfig":
        try:
            return msgspec.json.decode(data, type=cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"engine config: {exc}") from None


# ---- parallelism across worker processes ---------------------------------------------------

ALL2ALL_BACKENDS = ("auto", "all_to_all", "padded_all_to_all", "allgather_reducescatter")


@dataclass(frozen=True)
class ParallelConfig:
    """How worker processes split the model (vLLM's names). Data parallelism alone replicates
    the model per rank; with expert parallelism the ranks form one torch.distributed group, each
    holds its share of the routed experts (plus redundant replicas), and every MoE layer
    dispatches tokens to the ranks that own their experts, every rank stepping in lockstep."""

    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None  # ranks this node runs (None: all of them)
    data_parallel_start_rank: int = 0  # the first rank this node runs
    data_parallel_address: str = "127.0.0.1"  # the head node: rendezvous and request channel
    data_parallel_rpc_port: int = 29550  # head's request channel for headless nodes; the store is port + 1
    headless: bool = False  # run ranks, no HTTP server (a node other than the head)
    enable_expert_parallel: bool = False
    num_redundant_experts: int = 0
    enable_eplb: bool = False
    eplb_step_interval: int = 3000
    all2all_backend: str = "auto"  # auto: padded_all_to_all on CUDA (graph-capturable), all_to_all on CPU
    collective_timeout_s: float = 30.0  # a rank that stops answering fails the group after this long
    rendezvous_timeout_s: float = 300.0  # every rank must have joined the group by then

    def __post_init__(self) -> None:
        local = self.local_size
        checks = [
            (self.data_parallel_size >= 1, "data_parallel_size", "must be ≥ 1"),
            (1 <= local <= self.data_parallel_size, "data_parallel_size_local", "must be in [1, data-parallel-size]"),
            (0 <= self.data_parallel_start_rank <= self.data_parallel_size - local, "data_parallel_start_rank",
             "must leave room for this node's ranks"),
            (self.num_redundant_experts >= 0, "num_redundant_experts", "must be ≥ 0"),
            (self.num_redundant_experts == 0 or self.enable_expert_parallel, "num_redundant_experts",
             "needs --enable-expert-parallel"),
            (not self.enable_eplb or self.enable_expert_parallel, "enable_eplb", "needs --enable-expert-parallel"),
            (self.eplb_step_interval >= 1, "eplb_step_interval", "must be ≥ 1"),
            (self.all2all_backend in ALL2ALL_BACKENDS, "all2all_backend", f"must be one of {', '.join(ALL2ALL_BACKENDS)}"),
            (0 < self.data_parallel_rpc_port < 65535, "data_parallel_rpc_port", "must be a TCP port below 65535"),
            (not self.headless or self.data_parallel_start_rank > 0, "headless",
             "a headless node runs ranks after the head's (set --data-parallel-start-rank)"),
            (self.headless or self.data_parallel_start_rank == 0, "data_parallel_start_rank",
             "must be 0 on the head (other nodes run with --headless)"),
            (self.rendezvous_timeout_s > 0, "rendezvous_timeout_s", "must be positive"),
            (self.collective_timeout_s > 0, "collective_timeout_s", "must be positive"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ConfigError(f"--{name.replace('_', '-')} {rule}, got {getattr(self, name)!r}")

    @property
    def local_size(self) -> int:
        return self.data_parallel_size_local or (self.data_parallel_size - self.data_parallel_start_rank)

    @property
    def local_ranks(self) -> range:
        return range(self.data_parallel_start_rank, self.data_parallel_start_rank + self.local_size)

    @property
    def grouped(self) -> bool:
        """Whether the ranks form a torch.distributed group (expert parallelism across > 1 rank)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def multi_node(self) -> bool:
        return self.local_size < self.data_parallel_size

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> "ParallelConfig":
        try:
            return msgspec.json.decode(data, type=cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"parallel config: {exc}") from None
