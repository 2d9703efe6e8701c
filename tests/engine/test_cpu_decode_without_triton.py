"""The CPU engine's default decode path (the static fused forward on kernels/cpu_decode.py) needs
no Triton and never imports it: `ringserve serve` on a CPU install has only the runtime
dependencies (Triton is a test extra), and a process that loads Triton pays a second of start-up
and prints binding-leak noise at exit. Run in a subprocess whose import system refuses (and
records) every `triton` import."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import importlib.abc, json, sys

class NoTriton(importlib.abc.MetaPathFinder):
    attempts = []

    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            NoTriton.attempts.append(name)
            raise ImportError("Triton is not installed here")
        return None

sys.meta_path.insert(0, NoTriton())
import torch
from engine.config import EngineConfig
from engine.engine import Engine
from engine.weights import load_model
from ipc.messages import SamplingParams

model = load_model(sys.argv[1], dtype=torch.float32, progress=False)
engine = Engine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, num_kv_blocks=16, block_size=16,
                                    speculative_tokens=0, max_model_len=128))
for i in range(2):
    engine.add_request(i, [5 + i, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True))
tokens = {}
while engine.has_work:
    for d in engine.step().deltas:
        tokens.setdefault(d.request_id, []).extend(d.token_ids)
print(json.dumps({"static_runs": engine.static.num_runs, "tokens": tokens, "triton_imports": NoTriton.attempts}))
"""


def test_cpu_static_decode_runs_without_triton(checkpoint_factory):
    ckpt = checkpoint_factory("tiny-no-triton")
    env_path = str(REPO)
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(ckpt)], capture_output=True, text=True, timeout=300,
                         cwd=REPO, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["static_runs"] > 0          # decode steps took the static fused path
    assert result["triton_imports"] == []    # not even tried (kernels.devices checks only for CUDA)
    assert all(len(t) == 6 for t in result["tokens"].values())
