#!/usr/bin/env python3
"""Lay engine/ out by concern (issue 39, deliverable 2): DeepSeek-V4's model code into its own
package `engine/v4/` next to `engine/v41/`, each architecture's `Architecture` entry into its
package (`architecture.py`), and the distributed parts (DP/EP groups, all-to-all, EPLB, lockstep)
into `engine/distributed/`. The engine core (scheduler, block manager, KV pools, runner, sampler,
worker, static decode backends) stays in `engine/`.

Run it on a checkout of main that has not been moved yet:

    python scripts/dev/move_v4_package.py          # from anywhere; it finds the repository root

It (1) makes a few small edits the moves need (named in EDITS), (2) splits the modules that hold
both shared and architecture-specific code (SPLITS: top-level definitions move, each new module
gets the imports its definitions use, the old one loses the imports they alone used), (3) `git mv`s
whole modules (MOVES), then (4) rewrites every import of a moved module or name in every .py under
engine, ipc, kernels, server, train, perf, tests, tokenization and scripts (absolute and relative
imports, `from pkg import module`, `import a.b as c`), and every dotted name (`engine.model.X` in
mock targets and "module:attr" registry strings) and file path (`engine/model.py`) in the code's
strings and comments and in the tracked Markdown files. A tree already moved is left alone.

Before it changes anything it checks that every module, definition and text it relies on is there
(and that tracked files have no uncommitted changes: pass --allow-dirty to go on anyway), so a main
that has changed under it stops it with a message naming the file. docs/architecture.md, edited
by others too, is treated leniently: a passage it cannot find is reported and left as it is.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve()
SCRIPT = "scripts/dev/move_v4_package.py"  # never rewritten: its tables name the old paths
CODE_DIRS = ("engine", "ipc", "kernels", "server", "train", "perf", "tests", "tokenization", "scripts")
MAX_LINE = 120

# ---- whole modules: old path → new path ----------------------------------------------------

V4_MODULES = ("model", "attention", "attention_ops", "attention_decode", "moe", "mtp", "layers", "seq_state",
              "fused_decode", "packed_linear", "step_meta", "weight_formats")
DISTRIBUTED_MODULES = ("expert_parallel", "ep_moe", "all2all", "eplb", "lockstep", "rendezvous_store")

MOVES: dict[str, str] = {
    **{f"engine/{m}.py": f"engine/v4/{m}.py" for m in V4_MODULES},
    "engine/models/deepseek_v4.py": "engine/v4/architecture.py",
    "engine/models/deepseek_v41.py": "engine/v41/architecture.py",
    # the package takes the folder's name, so the group module gets its own
    "engine/distributed.py": "engine/distributed/group.py",
    **{f"engine/{m}.py": f"engine/distributed/{m}.py" for m in DISTRIBUTED_MODULES},
}

NEW_PACKAGES: dict[str, str] = {
    "engine/v4/__init__.py": '''"""DeepSeek-V4-Flash in the engine: the model (mHC residual streams, CSA/HCA attention with
the lightning indexer, sqrt-softplus MoE, the MTP draft layer), its fused static decode step, its
config dialects, checkpoint names and loading, KV layout and `make-model` writer, and its
`Architecture` entry (architecture.py).

Importing the package loads no torch (engine/config.py parses V4 configs through
`engine.v4.config`); the model modules import torch themselves.
"""
''',
    "engine/distributed/__init__.py": '''"""The parts that span worker processes: the torch.distributed group (group.py) and its
rendezvous store, data-parallel lockstep, and expert parallelism (the expert placement and EPLB,
the all-to-all backends, the expert-parallel MoE layer that dispatches through them).

An architecture supplies its own expert-parallel MoE through its `Architecture`
(engine/models/base.py); everything here serves any architecture.
"""
''',
}

# ---- modules split in two (or three): top-level names that move ----------------------------


@dataclass
class Split:
    src: str  # stays, keeps what is shared
    dst: str  # new module
    names: tuple[str, ...]  # top-level definitions (functions, classes, assignments) that move
    dst_doc: str  # the new module's docstring; "{src_doc}" stands for the source's old one
    src_doc: str | None = None  # the source's new docstring (None: unchanged)


V4_CONFIG_DOC = '''"""DeepSeek-V4's config.json → `ModelConfig` (engine/config.py); `ConfigError` names a bad key.

Both config dialects of DeepSeek-V4 are accepted:
  * the transformers dialect (`layer_types`, `compress_rates`, `mlp_layer_types`,
    nested `rope_parameters` with `main` / `compress`), and
  * the upstream dialect shipped with released checkpoints (`compress_ratios` per layer,
    `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`).
Everything the engine needs is normalised into `ModelConfig`; derived values are its properties.
No torch here.
"""'''

SHARED_CONFIG_DOC = '''"""Configuration: the model's (`ModelConfig`, read from a Hugging Face `config.json`) and the
engine's (`EngineConfig`, built from CLI flags or the offline API). Neither imports torch, so the
HTTP process can read them without loading the engine.

The architecture a config.json names (engine/models/registry.py) parses it into `ModelConfig`:
DeepSeek-V4's two dialects in engine/v4/config.py, V4.1's in engine/v41/config.py.
`ModelConfig` writes V4's dialects back (`to_transformers_dict`, `to_upstream_dict`).
"""'''

V4_WEIGHTS_DOC = '''"""Load a Hugging Face-format DeepSeek-V4 directory into `DeepseekV4` (`load_v4`, reached
through `engine.weights.load_model` and the registry), and build the model on the meta device.

Reads `config.json`, sharded safetensors (with `model.safetensors.index.json`) or one file,
in the upstream, transformers or saved-by-transformers tensor layout. Quantized weights are
  * FP8 e4m3 with one ue8m0 (or fp32) scale per block (`.scale` / `.weight_scale_inv`);
  * FP4 e2m1 packed two per int8 byte (low nibble = even column) with one ue8m0 scale per 32
    columns (routed experts, `expert_dtype: fp4`).
`weight_dtype="auto"` keeps them as stored, in the containers of engine/linear.py (the GEMM
kernels dequantize tile by tile); `"bf16"` decodes every weight into the compute dtype at
load (the upcast). Unquantized tensors load in the compute dtype either way (fp32 for the
leaves the model defines in fp32).

Loading is streamed: the model is planned and built on the meta device, allocated once on the
target device, and each tensor is read from its shard (safetensors reads lazily, one tensor
at a time), converted and copied into place. Host memory thus holds the model's share (when
the device is the CPU) plus one tensor. With `experts`, each MoE layer holds only the given
logical experts and the other experts' tensors are never read.

Every parameter must be filled exactly once with the right shape; anything else is a
`WeightLoadError` that names the tensor.
"""'''

SHARED_WEIGHTS_DOC = '''"""Safetensors checkpoints into a model, for every architecture.

`load_model` is the entry: the architecture that `config.json` names (engine/models/) builds its
model and fills it (DeepSeek-V4: engine/v4/weights.py, V4.1: engine/v41/weights.py). What they
share is here: the shards (`Checkpoint`, lazy by tensor name, headers read without the data),
FP8 / FP4 decoding (the upcast), the plan of which weight containers keep their stored format
(`stored_formats`), and `Filler`, which copies tensors into an allocated model and checks that
every parameter is filled exactly once with the right shape (`WeightLoadError` names the tensor).
"""'''

V4_NAMES_DOC = '''"""DeepSeek-V4's checkpoint tensor names, in the layouts users have, and their mapping to its parameters.

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
"""'''

SHARED_NAMES_DOC = '''"""Checkpoint tensor names → parameters: what the architectures' name maps share.

A checkpoint tensor maps to a `Target`: the internal parameter name, plus for per-expert tensors
the expert index and which part of the stacked expert tensor it fills (`EXPERT_PARTS`, the
upstream `w1` / `w3` / `w2`). `scale_name_of` lists the names a quantization scale may have.
DeepSeek-V4's layouts: engine/v4/weight_names.py; V4.1's release names: engine/v41/weight_names.py.
"""'''

V41_NAMES_DOC = '''"""DeepSeek-V4.1's checkpoint tensor names (the release's) and their mapping to its parameters
(`Target`, `EXPERT_PARTS`: engine/weight_names.py)."""'''

V4_LAYOUT_DOC = '''"""DeepSeek-V4's KV layout: every compressed layer owns its compressor and its pools (the pool
kinds, record formats and groups: engine/kv_layout.py)."""'''

V41_LAYOUT_DOC = '''"""DeepSeek-V4.1's KV layout: CSA2's cross-layer sharing (a ratio-m layer reads its group
source's pools) in the model's own record formats (the pool kinds and groups: engine/kv_layout.py)."""'''

V4_CHECKPOINT_DOC = '''"""Random-weight DeepSeek-V4 checkpoints (`ringserve make-model`): presets, init and writing.

Weights are drawn deterministically from (seed, tensor name), scaled so that activations stay
O(1) through the stack (which keeps greedy tokens away from near-ties), and written as
Hugging Face safetensors shards in the upstream or the transformers layout. With
`quantize="fp8-fp4"` the dense projections are stored as FP8 e4m3 with ue8m0 block scales and
the routed experts as FP4 e2m1 with ue8m0 scales per 32 (engine/checkpoint.py), the formats of
the released checkpoints; the model those bytes describe is then the dequantized one.
"""'''

SHARED_CHECKPOINT_DOC = '''"""Writing checkpoints in the release formats, for every architecture's `make-model`: FP8 e4m3
with ue8m0 block scales, FP4 e2m1 packed two per byte with a ue8m0 scale per group along K, and
safetensors shards with their index. DeepSeek-V4's writer: engine/v4/checkpoint.py; V4.1's:
engine/v41/checkpoint.py.
"""'''

SPLITS: list[Split] = [
    Split("engine/config.py", "engine/v4/config.py",
          ("_require", "parse_v4", "_rope_dim", "_compress_ratios", "_hash_layers", "_compress_rope", "_validate"),
          V4_CONFIG_DOC, SHARED_CONFIG_DOC),
    Split("engine/weights.py", "engine/v4/weights.py",
          ("logger", "_FP32_LEAVES", "keeps_fp32", "build_model", "_cast", "moe_layers", "configure",
           "_materialize", "_targets", "checkpoint_formats", "load_v4"),
          V4_WEIGHTS_DOC, SHARED_WEIGHTS_DOC),
    Split("engine/weight_names.py", "engine/v41/weight_names.py",
          ("_V41_EXPERT_RE", "_V41_NAME_RE", "v41_target_of", "v41_export_names"), V41_NAMES_DOC),
    Split("engine/weight_names.py", "engine/v4/weight_names.py",
          ("_LAYER_TABLE", "_TOP_TABLE", "_MTP_TABLE", "_UP_LAYER", "_HF_LAYER", "_UP_TOP", "_HF_TOP", "_UP_MTP",
           "_LAYER_RE", "_HF_LAYER_RE", "_MTP_RE", "_EXPERT_RE", "_SAVED_LAYER_RE", "_SAVED_TOP", "detect_layout",
           "_saved_to_upstream", "_layer_target", "target_of", "export_names", "_scale_export_name",
           "_export_names", "_export_layer"),
          V4_NAMES_DOC, SHARED_NAMES_DOC),
    Split("engine/kv_layout.py", "engine/v4/kv_layout.py", ("_formats", "build_v4_layout"), V4_LAYOUT_DOC),
    Split("engine/kv_layout.py", "engine/v41/kv_layout.py", ("_v41_formats", "build_v41_layout"), V41_LAYOUT_DOC),
    Split("engine/checkpoint.py", "engine/v4/checkpoint.py",
          ("_BASE", "PRESETS", "preset_config", "_generator", "_init_tensor", "_draw_name", "random_state",
           "_fp8_block", "_is_fp8", "export_tensors", "quantization_config", "write_checkpoint"),
          V4_CHECKPOINT_DOC, SHARED_CHECKPOINT_DOC),
]

# ---- small edits before the moves: (path, old text, new text), each old text exactly once ---

EDITS: list[tuple[str, str, str]] = [
    # engine/linear.py is shared (V4.1 builds on it): its SwiGLU comes from the shared maths, not V4's layers
    ("engine/linear.py", "from kernels.cpu_precision import bf16_operands\n\nfrom .layers import clamped_swiglu\n",
     "from kernels.cpu_precision import bf16_operands\nfrom kernels.model_math import clamped_swiglu\n"),
    # the engine and its runner take any architecture's model
    ("engine/engine.py", "from .model import DeepseekV4\n", ""),
    ("engine/engine.py", "def __init__(self, model: DeepseekV4,", "def __init__(self, model: torch.nn.Module,"),
    ("engine/model_runner.py", "from .model import DeepseekV4\n", ""),
    ("engine/model_runner.py", "def __init__(self, model: DeepseekV4,", "def __init__(self, model: torch.nn.Module,"),
    # the shared half of weights.py fills any architecture's model
    ("engine/weights.py", "def __init__(self, model: DeepseekV4, ckpt: Checkpoint",
     "def __init__(self, model: nn.Module, ckpt: Checkpoint"),
    ("engine/weights.py", "language_model_only: bool = False) -> DeepseekV4:",
     "language_model_only: bool = False) -> nn.Module:"),
    # V4's config parser (engine/v4/config.py) reads the layer-type names ModelConfig writes back
    ("engine/config.py", "_LAYER_TYPE_TO_KIND = {", "LAYER_TYPE_TO_KIND = {"),
    ("engine/config.py", "_KIND_TO_LAYER_TYPE = {v: k for k, v in _LAYER_TYPE_TO_KIND.items()}",
     "_KIND_TO_LAYER_TYPE = {v: k for k, v in LAYER_TYPE_TO_KIND.items()}"),
    ("engine/config.py", "        bad = [t for t in types if t not in _LAYER_TYPE_TO_KIND]\n",
     "        bad = [t for t in types if t not in LAYER_TYPE_TO_KIND]\n"),
    ("engine/config.py", "        kinds = [_LAYER_TYPE_TO_KIND[t] for t in types]\n",
     "        kinds = [LAYER_TYPE_TO_KIND[t] for t in types]\n"),
    ("engine/__init__.py",
     '"""ringserve\'s engine: the DeepSeek-V4 model, its per-sequence state, weights and generation.\n',
     '"""ringserve\'s engine: one device\'s serving of any registered architecture.\n\n'
     "The core is here (engine.py, scheduler, block manager, KV pools and layout, model runner,\n"
     "sampler, prefix cache, static decode backends, worker); `models/` says what an architecture\n"
     "provides and maps config.json to one; `v4/` (DeepSeek-V4) and `v41/` (DeepSeek-V4.1) are the\n"
     "architectures; `distributed/` spans worker processes (DP/EP, all-to-all, EPLB); `kv_transfer/`\n"
     "moves KV between engines (PD disaggregation).\n"),
    ("engine/models/__init__.py",
     "`registry` (config.json → architecture), and the built-in DeepSeek-V4 / V4.1 entries.",
     "`registry` (config.json → architecture). The built-in architectures are packages of their own:\n"
     "DeepSeek-V4 in engine/v4/, DeepSeek-V4.1 in engine/v41/ (each `architecture.py`)."),
    ("engine/models/deepseek_v4.py",
     '"""DeepSeek-V4 as an `Architecture`: its parts are engine/config.py `parse_v4`, engine/weights.py,\n'
     'engine/kv_layout.py `build_v4_layout`, engine/kv_cache.py, engine/model_runner.py and\n'
     'engine/checkpoint.py (make-model). No torch at import."""',
     '"""DeepSeek-V4 as an `Architecture`: its parts are this package\'s (config.py `parse_v4`,\n'
     'weights.py `load_v4`, kv_layout.py `build_v4_layout`, checkpoint.py for make-model) and the\n'
     'engine core\'s KV cache and model runner (engine/kv_cache.py, engine/model_runner.py).\n'
     'No torch at import."""'),
    ("engine/models/deepseek_v41.py",
     '"""DeepSeek-V4.1 as an `Architecture`: its parts live in engine/v41/ (config, weights, KV cache,\n'
     'runner, static decode, DSpark, expert-parallel MoE, vision) and engine/kv_layout.py\n'
     '`build_v41_layout`. No torch at import."""',
     '"""DeepSeek-V4.1 as an `Architecture`: its parts live in this package (config, weights, KV\n'
     'layout and cache, runner, static decode, DSpark, expert-parallel MoE, vision). No torch at\n'
     'import."""'),
]

# ---- edits after the rewrite (docs naming the layout): (path, old text, new text) -----------

ROOMS_ROW = "| `engine/` |"  # the rooms table's engine row, replaced whole by ROOMS_NEW
ROOMS_NEW = (
    "| `engine/` | one device's engine, the core: `engine.py`, `scheduler.py`, `block_manager.py`, `kv_cache.py`, "
    "`kv_layout.py` (pool kinds and formats), `model_runner.py`, `sampler.py`, `prefix_cache.py`, the attention "
    "backends (`attention_backend.py`, `decode_batch.py`, `cuda_graphs.py`), the shared weight containers and "
    "loading (`linear.py`, `weights.py`, `weight_names.py`, `checkpoint.py`), `config.py`, `worker*.py` | "
    "`ipc`, `kernels` |\n"
    "| `engine/models/` | the architecture interface (`base.py`) and registry (`registry.py`) | the core |\n"
    "| `engine/v4/`, `engine/v41/` | the architectures, laid out alike: `architecture.py` (the `Architecture` "
    "entry), `config.py`, `model.py`, `attention.py`, `moe.py`, `weights.py`, `weight_names.py`, "
    "`kv_layout.py`, `checkpoint.py`; V4 adds `mtp.py`, `layers.py`, its fused static decode "
    "(`fused_decode.py`, `attention_decode.py`); V4.1 its runner, static decode, DSpark, Engram and vision | "
    "the core, `models` |\n"
    "| `engine/distributed/` | what spans worker processes: the torch.distributed group (`group.py`) and its "
    "rendezvous store, lockstep, expert parallelism (`expert_parallel.py`, `ep_moe.py`, `all2all.py`, "
    "`eplb.py`) | the core |\n"
    "| `engine/kv_transfer/` | PD disaggregation: the transfer protocol and its transports | the core |")

ENGINE_ARROWS = (
    "Inside `engine/`, V4.1's package imports nothing of V4's; the core still reaches V4's attention\n"
    "maths from its attention backends: `attention_backend.py` runs `engine/v4/attention.py`'s\n"
    "`SequenceContext` (the toy's window attention too), `decode_batch.py` calls\n"
    "`engine/v4/attention_decode.py`, and `cuda_graphs.py` (the generic static decode) runs\n"
    "`engine/v4/fused_decode.py` on a `DeepseekV4`.\n")
ARROWS_AFTER = "Arrows point down this table."  # ENGINE_ARROWS goes after the paragraph that starts so

# Edits of docs/architecture.md's other sections where main still has them (after the rewrite of
# paths and dotted names); one whose text is not there is reported and skipped.
DOC_EDITS: list[tuple[str, str, str]] = [
    ("docs/architecture.md",
     "| config parsing and validation | `parse_config(raw)` | `engine.v4.config.parse_v4` | `engine/v41/config.py` |",
     "| config parsing and validation | `parse_config(raw)` | `engine/v4/config.py` | `engine/v41/config.py` |"),
    ("docs/architecture.md",
     "| model build + weight loading (EP share) | `load_model(dir, …, experts=…)` | `engine.v4.weights.load_v4` "
     "| `engine/v41/weights.py` |",
     "| model build + weight loading (EP share) | `load_model(dir, …, experts=…)` | `engine/v4/weights.py` "
     "| `engine/v41/weights.py` |"),
    ("docs/architecture.md", "| checkpoint writing (`make-model --arch`) | `write_checkpoint(out, preset, …)` | "
     "`engine/checkpoint.py` | `engine/v41/checkpoint.py` |",
     "| checkpoint writing (`make-model --arch`) | `write_checkpoint(out, preset, …)` | "
     "`engine/v4/checkpoint.py` | `engine/v41/checkpoint.py` |"),
    ("docs/architecture.md", "| KV layout | `kv_layout(cfg, kv_dtype, …)` | `kv_layout.build_v4_layout` | "
     "`kv_layout.build_v41_layout` |",
     "| KV layout | `kv_layout(cfg, kv_dtype, …)` | `engine/v4/kv_layout.py` | `engine/v41/kv_layout.py` |"),
    ("docs/architecture.md", "`engine/models/registry.py` maps a `config.json` to one (by\n"
     "`model_type`, else by `architectures`). Nothing outside `engine/models/` and an architecture's\n"
     "own package tests an architecture's name",
     "`engine/models/registry.py` maps a `config.json` to one (by\n"
     "`model_type`, else by `architectures`); each built-in's entry is its package's `architecture.py`\n"
     "(`engine/v4/architecture.py`, `engine/v41/architecture.py`). Nothing outside `engine/models/` and an\n"
     "architecture's own package tests an architecture's name"),
]


def edit_docs() -> list[str]:
    """The layout in docs/architecture.md: the engine's rows of the rooms table, the arrows left
    inside engine/, and the architecture table's paths. Returns what it could not find."""
    file = ROOT / "docs/architecture.md"
    text = file.read_text()
    skipped = []
    lines = text.split("\n")
    rows = [i for i, line in enumerate(lines) if line.startswith(ROOMS_ROW)]
    if len(rows) == 1:
        lines[rows[0]] = ROOMS_NEW
    else:
        skipped.append(f"the rooms table's engine row ({len(rows)} lines start with {ROOMS_ROW!r})")
    starts = [i for i, line in enumerate(lines) if line.startswith(ARROWS_AFTER)]
    if len(starts) == 1:
        end = starts[0]
        while end < len(lines) and lines[end].strip():
            end += 1
        lines[end:end] = [""] + ENGINE_ARROWS.rstrip("\n").split("\n")
    else:
        skipped.append(f"the paragraph starting {ARROWS_AFTER!r} (found {len(starts)})")
    text = "\n".join(lines)
    for _, old, new in DOC_EDITS:
        if text.count(old) == 1:
            text = text.replace(old, new)
        else:
            skipped.append(old.split("\n")[0][:80])
    file.write_text(text)
    return skipped


# ---- the rewrite -----------------------------------------------------------------------------


def die(message: str) -> None:
    sys.exit(f"move_v4_package: {message}")


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout


def dotted(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str, is_init: bool) -> list[str]:
    parts = module.split(".")
    return parts if is_init else parts[:-1]


@dataclass
class Maps:
    modules: dict[str, str] = field(default_factory=dict)  # old dotted module → new
    names: dict[tuple[str, str], str] = field(default_factory=dict)  # (old module, name) → new module
    known: set[str] = field(default_factory=set)  # every module name before the move (to tell submodules from names)
    paths: dict[str, str] = field(default_factory=dict)  # old file path → new (whole moves)


def build_maps() -> Maps:
    maps = Maps()
    for old, new in MOVES.items():
        maps.modules[dotted(old)] = dotted(new)
        maps.paths[old] = new
    for split in SPLITS:
        for name in split.names:
            maps.names[(dotted(split.src), name)] = dotted(split.dst)
    for path in git("ls-files", "*.py").splitlines():
        maps.known.add(dotted(path))
        parent = dotted(path).rpartition(".")[0]
        while parent:
            maps.known.add(parent)
            parent = parent.rpartition(".")[0]
    return maps


def render_from(module: list[str], level: int, aliases: list[ast.alias], indent: str, tail: str) -> str:
    prefix = "." * level + ".".join(module)
    names = [a.name if a.asname is None else f"{a.name} as {a.asname}" for a in aliases]
    line = f"{indent}from {prefix} import {', '.join(names)}{tail}"
    if len(line) <= MAX_LINE or len(names) == 1:
        return line
    rows = "".join(f"{indent}    {n},\n" for n in names)
    return f"{indent}from {prefix} import ({tail}\n{rows}{indent})"


def relative(importer_pkg: list[str], target: list[str]) -> tuple[list[str], int]:
    """(module parts, level) of `target` imported relatively from package `importer_pkg`."""
    common = 0
    while common < min(len(importer_pkg), len(target)) and importer_pkg[common] == target[common]:
        common += 1
    return target[common:], len(importer_pkg) - common + 1


def rewrite_imports(text: str, old_module: str, new_module: str, is_init: bool, maps: Maps) -> str:
    """Rewrite the import statements of one file (`old_module`, now `new_module`) that name a moved
    module or name: absolute ones stay absolute, relative ones are made relative to the new place."""
    tree = ast.parse(text)
    lines = text.split("\n")
    old_pkg, new_pkg = package_of(old_module, is_init), package_of(new_module, is_init)
    moved_file = old_module != new_module
    replacements: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]
        indent, tail = first[: node.col_offset], last[node.end_col_offset:]
        if isinstance(node, ast.Import):
            changed = False
            out = []
            for a in node.names:
                target = a.name
                for old, new in maps.modules.items():
                    if target == old or target.startswith(old + "."):
                        target = new + target[len(old):]
                        changed = True
                        break
                out.append(target if a.asname is None else f"{target} as {a.asname}")
            if changed:
                replacements.append((node.lineno, node.end_lineno, f"{indent}import {', '.join(out)}{tail}"))
            continue
        if node.level:
            base = old_pkg[: len(old_pkg) - (node.level - 1)]
            source = base + (node.module.split(".") if node.module else [])
        else:
            source = node.module.split(".")
        src = ".".join(source)
        groups: dict[str, list[ast.alias]] = {}
        for a in node.names:
            full = f"{src}.{a.name}"
            if full in maps.known and a.name != "*":  # `from pkg import module`
                new_full = maps.modules.get(full, full)
                parent, _, leaf = new_full.rpartition(".")
                alias = a if leaf == a.name else ast.alias(leaf, a.asname or a.name)
                groups.setdefault(parent, []).append(alias)
            else:
                dest = maps.names.get((src, a.name), maps.modules.get(src, src))
                groups.setdefault(dest, []).append(a)
        if list(groups) == [src] and not (moved_file and node.level):
            continue
        rendered = []
        for dest, aliases in groups.items():
            parts = dest.split(".")
            if node.level and parts[0] == new_pkg[0]:
                module, level = relative(new_pkg, parts)
            else:
                module, level = parts, 0
            noqa = tail if tail.strip().startswith("# noqa") else ""
            rendered.append(render_from(module, level, aliases, indent, tail if not rendered else noqa))
        new_text = "\n".join(rendered)
        if new_text != "\n".join(lines[node.lineno - 1: node.end_lineno]):
            replacements.append((node.lineno, node.end_lineno, new_text))
    for start, end, new_text in sorted(replacements, reverse=True):
        lines[start - 1: end] = new_text.split("\n")
    return "\n".join(lines)


def text_patterns(maps: Maps) -> list[tuple[re.Pattern, object]]:
    """One pattern for every old dotted name and file path (one pass, so nothing is rewritten twice:
    `engine.expert_parallel` becomes `engine.distributed.expert_parallel`, which `engine.distributed`
    must then not touch)."""
    table = {f"{module}.{name}": f"{dest}.{name}" for (module, name), dest in maps.names.items()}
    table.update(maps.modules)
    table.update(maps.paths)
    alternatives = "|".join(re.escape(old) for old in sorted(table, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w./])(?:{alternatives})(?!\w)")
    return [(pattern, lambda m: table[m.group(0)])]


def rewrite_text(text: str, patterns) -> str:
    """Markdown: every mention."""
    for pattern, new in patterns:
        text = pattern.sub(new, text)
    return text


def rewrite_strings_and_comments(text: str, patterns) -> str:
    """Apply the patterns inside string literals and comments only: in code, `engine.model.cfg`
    may be an attribute chain on a variable called `engine`."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    pieces, last = [], 0
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.STRING, tokenize.COMMENT):
            continue
        begin = starts[tok.start[0] - 1] + tok.start[1]
        end = starts[tok.end[0] - 1] + tok.end[1]
        literal = text[begin:end]
        for pattern, new in patterns:
            literal = pattern.sub(new, literal)
        pieces += [text[last:begin], literal]
        last = end
    pieces.append(text[last:])
    return "".join(pieces)


def dotted_expr(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted_expr(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def rewrite_module_references(text: str, maps: Maps) -> str:
    """After `import engine.attention` (no alias), code names the module by its path
    (`engine.attention.top_k_entries`): those references follow the move."""
    tree = ast.parse(text)
    plain = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names if a.asname is None}
    moved = {old: new for old, new in maps.modules.items() if old in plain}
    if not moved:
        return text
    lines = text.split("\n")
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and dotted_expr(node) in moved and node.lineno == node.end_lineno:
            hits.append((node.lineno, node.col_offset, node.end_col_offset, moved[dotted_expr(node)]))
    for line, begin, end, new in sorted(hits, reverse=True):
        row = lines[line - 1].encode()  # ast offsets count UTF-8 bytes
        lines[line - 1] = (row[:begin] + new.encode() + row[end:]).decode()
    return "\n".join(lines)


def import_sort_key(node: ast.stmt) -> tuple:
    """isort's order within a section: plain imports, then from-imports; relative ones furthest first."""
    if isinstance(node, ast.Import):
        return (0, 0, node.names[0].name.lower())
    return (1, -node.level, (node.module or "").lower())


def import_root(node: ast.stmt) -> str:
    if isinstance(node, ast.Import):
        return node.names[0].name.split(".")[0]
    return "." if node.level else (node.module or "").split(".")[0]


def split_by_root(run: list[ast.stmt]) -> list[list[ast.stmt]]:
    """The stretches of a run that import from one package (or relatively): only those are
    re-sorted, so imports of other packages keep their places."""
    parts: list[list[ast.stmt]] = []
    for node in run:
        if parts and import_root(parts[-1][-1]) == import_root(node):
            parts[-1].append(node)
        else:
            parts.append([node])
    return [p for p in parts if len(p) > 1]


def sort_changed_import_runs(text: str, before: str) -> str:
    """Re-sort each run of adjacent one-line imports that holds a rewritten line (one the file did
    not have before), so a moved module's import takes its place in the run."""
    old_lines = set(before.split("\n"))
    lines = text.split("\n")
    tree = ast.parse(text)
    runs: list[list[ast.stmt]] = []
    for holder in ast.walk(tree):
        body = getattr(holder, "body", None)
        if not isinstance(body, list):
            continue
        run: list[ast.stmt] = []
        for node in body + [None]:
            one_line_import = (isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno == node.end_lineno
                               and not (isinstance(node, ast.ImportFrom) and node.module == "__future__"))
            if one_line_import and run and node.lineno == run[-1].end_lineno + 1:
                run.append(node)
                continue
            runs += split_by_root(run)
            run = [node] if one_line_import else []
    for run in runs:
        rows = [lines[n.lineno - 1] for n in run]
        if all(r in old_lines for r in rows):
            continue
        ordered = [lines[n.lineno - 1] for n in sorted(run, key=import_sort_key)]
        lines[run[0].lineno - 1: run[-1].lineno] = ordered
    return "\n".join(lines)


def rewrite_python(text: str, old_path: str, new_path: str, maps: Maps, patterns) -> str:
    """Imports of moved modules and names, code that names a moved module by its path, then
    dotted names and paths in strings and comments."""
    before = text
    text = rewrite_module_references(text, maps)
    text = rewrite_imports(text, dotted(old_path), dotted(new_path), new_path.endswith("__init__.py"), maps)
    text = sort_changed_import_runs(text, before)
    return rewrite_strings_and_comments(text, patterns)


# ---- splitting -------------------------------------------------------------------------------


def top_level_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def node_span(node: ast.stmt, lines: list[str]) -> tuple[int, int]:
    """1-based inclusive span of a top-level statement with its decorators and the comment lines
    directly above it."""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    while start > 1 and lines[start - 2].startswith("#"):
        start -= 1
    return start, node.end_lineno


def used_names(text: str) -> set[str]:
    tree = ast.parse(text)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}


def bound_name(alias: ast.alias, is_import: bool) -> str:
    if alias.asname:
        return alias.asname
    return alias.name.split(".")[0] if is_import else alias.name


def tidy(text: str) -> str:
    """Drop section-header comments left with nothing under them and runs of blank lines."""
    lines = text.split("\n")
    out: list[str] = []
    for i, line in enumerate(lines):
        if line.startswith("# ----"):
            rest = [ln for ln in lines[i + 1:] if ln.strip()]
            if not rest or rest[0].startswith("# ----"):
                continue
        out.append(line)
    text = re.sub(r"\n{4,}", "\n\n\n", "\n".join(out))
    return text.rstrip("\n") + "\n"


def module_docstring_span(tree: ast.Module) -> tuple[int, int] | None:
    if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant) \
            and isinstance(tree.body[0].value.value, str):
        return tree.body[0].lineno, tree.body[0].end_lineno
    return None


def do_split(split: Split, maps: Maps, patterns) -> None:
    src_path, dst_path = ROOT / split.src, ROOT / split.dst
    text = src_path.read_text()
    tree = ast.parse(text)
    lines = text.split("\n")
    src_module, dst_module = dotted(split.src), dotted(split.dst)
    wanted = set(split.names)
    moving, spans = [], []
    for node in tree.body:
        names = top_level_names(node)
        if names and set(names) <= wanted:
            moving.append(node)
            spans.append(node_span(node, lines))
            wanted -= set(names)
    if wanted:
        die(f"{split.src}: no top-level definition of {sorted(wanted)}")
    chunks = []
    for i, (s, e) in enumerate(spans):
        if i:  # definitions that stood together keep their spacing; others get two blank lines
            gap = lines[spans[i - 1][1]: s - 1]
            chunks.append("\n" * len(gap) if not any(g.strip() for g in gap) else "\n\n")
        chunks.append("\n".join(lines[s - 1: e]) + "\n")
    body = "".join(chunks)
    body = rewrite_python(body, split.src, split.dst, maps, patterns)
    for s, e in sorted(spans, reverse=True):
        del lines[s - 1: e]
    remaining = "\n".join(lines)
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    defined_left = {name for node in ast.parse(remaining).body for name in top_level_names(node)}
    uses_body = used_names(body)
    remaining_tree = ast.parse(remaining)
    uses_left = {n.id for n in ast.walk(remaining_tree) if isinstance(n, ast.Name)} | {
        n.value.id for n in ast.walk(remaining_tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    moved_names = set(split.names)
    still_needed = uses_left & moved_names
    if still_needed:
        die(f"{split.src} still uses {sorted(still_needed)} after the split")
    # the new module's imports: the source's, kept where the moved definitions use them
    dst_pkg = package_of(dst_module, False)
    header_groups: list[list[str]] = [[]]
    relative_lines: list[str] = []
    previous_end = None
    for node in imports:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if previous_end is not None and node.lineno - previous_end > 1 and header_groups[-1]:
            header_groups.append([])
        previous_end = node.end_lineno
        is_import = isinstance(node, ast.Import)
        keep = [a for a in node.names if bound_name(a, is_import) in uses_body]
        if not keep:
            continue
        if is_import:
            header_groups[-1].append("import " + ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}"
                                                         for a in keep))
            continue
        stub = ast.ImportFrom(module=node.module, names=keep, level=node.level)
        rendered = rewrite_python(ast.unparse(stub) + "\n", split.src, split.dst, maps, patterns).strip()
        for line in rendered.split("\n"):  # a name split between modules renders as two statements
            (relative_lines if line.startswith("from .") else header_groups[-1]).append(line)
    from_src = sorted((uses_body & defined_left) - moved_names, key=lambda n: (not n.isupper(), not n[0].isupper(), n))
    if from_src:
        module, level = relative(dst_pkg, src_module.split("."))
        relative_lines.append(render_from(module, level, [ast.alias(n) for n in from_src], "", ""))
    header = "\n\n".join("\n".join(g) for g in header_groups if g)
    rel_text = "\n".join(sorted(relative_lines, key=lambda line: (-_level(line), line)))
    src_doc = ast.get_docstring(tree, clean=False) or ""
    dst_doc = split.dst_doc.replace("{src_doc}", src_doc)
    parts = [dst_doc, "from __future__ import annotations"] + [p for p in (header, rel_text) if p]
    dst_text = "\n\n".join(parts) + "\n\n\n" + body
    if dst_path.exists():
        die(f"{split.dst} exists already")
    dst_path.parent.mkdir(parents=True, exist_ok=True)
    dst_path.write_text(tidy(dst_text))
    # the source loses the imports only the moved definitions used
    unused = (uses_body - uses_left)
    remaining = prune_imports(remaining, unused)
    if split.src_doc is not None:
        rt = ast.parse(remaining)
        span = module_docstring_span(rt)
        rl = remaining.split("\n")
        rl[span[0] - 1: span[1]] = split.src_doc.split("\n")
        remaining = "\n".join(rl)
    src_path.write_text(tidy(remaining))


def _level(line: str) -> int:
    return len(line[len("from "):]) - len(line[len("from "):].lstrip("."))


def prune_imports(text: str, unused: set[str]) -> str:
    tree = ast.parse(text)
    lines = text.split("\n")
    edits = []
    for node in tree.body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        is_import = isinstance(node, ast.Import)
        keep = [a for a in node.names if bound_name(a, is_import) not in unused]
        if len(keep) == len(node.names):
            continue
        if not keep:
            edits.append((node.lineno, node.end_lineno, None))
            continue
        if is_import:
            new = "import " + ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in keep)
        else:
            new = render_from(node.module.split(".") if node.module else [], node.level, keep, "", "")
        edits.append((node.lineno, node.end_lineno, new))
    for start, end, new in sorted(edits, reverse=True):
        lines[start - 1: end] = [] if new is None else new.split("\n")
    text = "\n".join(lines)
    # an import group left empty leaves two blank lines between its neighbours
    return re.sub(r"(\n(?:from|import) [^\n]*)\n\n\n(?=(?:from|import) )", r"\1\n\n", text)


# ---- main ------------------------------------------------------------------------------------


def edit(path: str, old: str, new: str) -> None:
    file = ROOT / path
    file.write_text(file.read_text().replace(old, new, 1))


def preflight() -> None:
    """Everything the script relies on is there, before it changes anything."""
    missing = [p for p in list(MOVES) + [s.src for s in SPLITS] if not (ROOT / p).exists()]
    if missing:
        die(f"not found (is this main before the move?): {', '.join(missing)}")
    taken = [p for p in list(MOVES.values()) + [s.dst for s in SPLITS] + list(NEW_PACKAGES) if (ROOT / p).exists()]
    if taken:
        die(f"already there: {', '.join(taken)}")
    for path, old, _ in EDITS:
        count = (ROOT / path).read_text().count(old)
        if count != 1:
            die(f"{path}: expected the text to replace once, found it {count} times:\n{old}")
    for split in SPLITS:
        defined = {n for node in ast.parse((ROOT / split.src).read_text()).body for n in top_level_names(node)}
        if set(split.names) - defined:
            die(f"{split.src}: no top-level definition of {sorted(set(split.names) - defined)}")
    dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    if dirty and "--allow-dirty" not in sys.argv[1:]:
        die(f"the work tree has uncommitted changes; commit or set them aside first:\n{dirty}")


def main() -> None:
    if (ROOT / "engine/v4/model.py").exists():
        print("move_v4_package: engine/v4/ exists already; nothing to do")
        return
    preflight()
    maps = build_maps()
    patterns = text_patterns(maps)
    originals = [p for p in git("ls-files", *CODE_DIRS).splitlines() if p.endswith(".py")]
    for path, old, new in EDITS:
        edit(path, old, new)
    created = []
    for split in SPLITS:
        do_split(split, maps, patterns)
        created.append(split.dst)
    for path, text in NEW_PACKAGES.items():
        (ROOT / path).parent.mkdir(parents=True, exist_ok=True)
        (ROOT / path).write_text(text)
        created.append(path)
    for old, new in MOVES.items():
        (ROOT / new).parent.mkdir(parents=True, exist_ok=True)
        git("mv", old, new)
    git("add", *created)
    self_rel = str(SELF.relative_to(ROOT)) if SELF.is_relative_to(ROOT) else SCRIPT
    for old_path in originals:
        new_path = MOVES.get(old_path, old_path)
        if old_path in (self_rel, SCRIPT):
            continue
        file = ROOT / new_path
        text = file.read_text()
        new_text = rewrite_python(text, old_path, new_path, maps, patterns)
        if new_text != text:
            file.write_text(new_text)
    for doc in git("ls-files", "*.md").splitlines():
        file = ROOT / doc
        text = file.read_text()
        new_text = rewrite_text(text, patterns)
        if new_text != text:
            file.write_text(new_text)
    skipped = edit_docs()
    print(f"move_v4_package: moved {len(MOVES)} modules, split {len(SPLITS)}, created {len(created)} files")
    for what in skipped:
        print(f"move_v4_package: docs/architecture.md: not found, left as it is: {what}")


if __name__ == "__main__":
    main()
