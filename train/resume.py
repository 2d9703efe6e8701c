"""Resumable training state: model, MTP layer, AdamW moments, batch sampler and step, in one file.

A training run on a shared CPU takes about an hour; a kill (an environment restart, a stopped
job) must cost at most the steps since the last save, not the run. The state is a safetensors
file (tensors only, no object serialization) with a JSON metadata entry for the scalars, written under a
temporary name and renamed into place, so a kill mid-write leaves the previous state intact.

Resuming needs the same run: `fingerprint` names the arguments that decide the trajectory
(everything but paths, threads and logging), and the tokenizer's hash is checked too, so a
state file is never continued with different data or a different schedule.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

STATE_FILE = "train-state.safetensors"
# Arguments that do not change which weights the run ends with.
_NOT_TRAJECTORY = {"out_dir", "work_dir", "deb", "html_dir", "threads", "log_every", "checkpoint_every", "resume", "export_saved_state",
                   "eval_windows", "test_data_dir", "export_dtype", "func", "device"}


def fingerprint(args, tokenizer_json: str) -> dict:
    """What a state file must match to be resumed: trajectory arguments and the tokenizer's sha256."""
    kept = {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_TRAJECTORY}
    return {"arguments": kept, "tokenizer_sha256": hashlib.sha256(tokenizer_json.encode()).hexdigest()}


@dataclass
class State:
    step: int  # steps done
    elapsed_s: float  # training wall time so far
    recent: list  # losses since the last log line, [(lm, mtp, kl), …]


def _params(opt: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for group in opt.param_groups for p in group["params"]]


def save(path: Path, lm, mtp, opt: torch.optim.Optimizer, gen: torch.Generator, state: State, fp: dict) -> None:
    """Write the whole training state atomically (tmp file + rename)."""
    tensors: dict[str, torch.Tensor] = {}
    for prefix, module in (("lm.", lm), ("mtp.", mtp)):
        for name, t in module.state_dict().items():
            tensors[prefix + name] = t.detach().to("cpu").clone().contiguous()  # clone: no shared storage
    for i, p in enumerate(_params(opt)):
        for key, t in opt.state.get(p, {}).items():
            tensors[f"opt.{i}.{key}"] = t.detach().to("cpu").clone().contiguous().reshape(t.shape)
    tensors["sampler"] = gen.get_state()
    meta = {"state": json.dumps({"step": state.step, "elapsed_s": state.elapsed_s, "recent": state.recent}),
            "fingerprint": json.dumps(fp, sort_keys=True)}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def load(path: Path, lm, mtp, opt: torch.optim.Optimizer, gen: torch.Generator, fp: dict) -> State:
    """Restore a state written by `save` into freshly built modules and optimizer."""
    state, tensors = load_weights(path, lm, mtp, fp)
    for i, p in enumerate(_params(opt)):
        keys = [k for k in tensors if k.startswith(f"opt.{i}.")]
        if keys:
            opt.state[p] = {k.rsplit(".", 1)[1]: tensors[k].to(p.device) if tensors[k].dim() else tensors[k]
                            for k in keys}
    gen.set_state(tensors["sampler"])
    return state


def starting_state(path: Path, lm, mtp, opt: torch.optim.Optimizer, gen: torch.Generator, fp: dict,
                   resume: bool, log) -> State:
    """Where a run starts: with `resume` and a saved state, that state restored (and logged),
    else step 0."""
    if resume and path.exists():
        state = load(path, lm, mtp, opt, gen, fp)
        log({"resumed_at_step": state.step})
        return State(state.step, state.elapsed_s, list(state.recent))
    return State(0, 0.0, [])


def export_saved_state(path: Path, lm, mtp, fp: dict, steps: int, log) -> dict:
    """--export-saved-state: the saved state's weights into lm / mtp; returns the training summary
    recipe.json records for a run stopped there."""
    state, _ = load_weights(path, lm, mtp, fp)
    log({"exported_saved_state_at_step": state.step})
    return {"step": state.step, "of_steps": steps, "stopped_early": state.step < steps, "elapsed_s": state.elapsed_s}


def load_weights(path: Path, lm, mtp, fp: dict) -> tuple[State, dict[str, torch.Tensor]]:
    """Only the model and MTP weights of a saved state (to export a run stopped early), and every
    saved tensor. A `fp` without a tokenizer hash checks the arguments only."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        saved = json.loads(meta["fingerprint"])
        if "tokenizer_sha256" not in fp:
            saved.pop("tokenizer_sha256", None)
        if saved != fp:
            raise ValueError(f"{path}: written by a run with other arguments or another tokenizer "
                             f"({meta['fingerprint']} vs {json.dumps(fp, sort_keys=True)}); delete it to start over")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for prefix, module in (("lm.", lm), ("mtp.", mtp)):
        own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        module.load_state_dict(own, strict=True)
    s = json.loads(meta["state"])
    return State(s["step"], s["elapsed_s"], [tuple(r) for r in s["recent"]]), tensors
