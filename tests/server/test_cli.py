"""`ringserve make-model` and `ringserve generate` as a user runs them (real subprocesses)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from engine.weights import load_model
from ipc.messages import SamplingParams
from reference_driver import generate


def ringserve(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "server.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}): {proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    proc = ringserve("make-model", str(out), "--arch", "v4", "--preset", "tiny", "--seed", "7")
    assert "tiny" in proc.stdout
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).exists(), name
    return out


def test_generate_json_prompts_file_in_input_order(tiny_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    lines = [{"prompt": "Hello there"}, {"prompt_ids": [5, 9, 200, 31]}, {"prompt": "A longer prompt " * 5}]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    proc = ringserve("generate", str(tiny_dir), "--prompts-file", str(prompts), "--max-tokens", "6",
                     "--logprobs", "0", "--json", "--ignore-eos")
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    assert records[1]["prompt_tokens"] == 4
    for r in records:
        assert len(r["token_ids"]) == 6 and r["finish_reason"] == "length"
        assert len(r["logprobs"]) == 6 and all(lp <= 0 for lp in r["logprobs"])
        assert isinstance(r["text"], str)
    # Each prompt alone gives the same tokens as in the concurrent run.
    alone = ringserve("generate", str(tiny_dir), "--prompt-ids", "5,9,200,31", "--max-tokens", "6", "--json",
                      "--ignore-eos")
    assert json.loads(alone.stdout)["token_ids"] == records[1]["token_ids"]


def test_sampled_generation_is_reproducible_with_a_seed(tiny_dir):
    args = ("generate", str(tiny_dir), "--prompt", "seeded", "--max-tokens", "8", "--temperature", "1.0",
            "--top-p", "0.9", "--top-k", "50", "--seed", "11", "--json", "--ignore-eos")
    first, second = ringserve(*args), ringserve(*args)
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]


def test_generation_stops_at_eos_like_transformers(tiny_dir):
    model = load_model(tiny_dir, dtype=torch.float32, progress=False)
    prompt = [5, 9, 200, 31]
    free = generate(model, [prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
    # Declare the third greedy token the EOS: generation must end there, EOS included.
    stopped = generate(model, [prompt], SamplingParams(max_tokens=5), eos_token_ids=(free[2],))[0]
    assert stopped.token_ids == free[:3] and stopped.finish_reason == "stop"


@pytest.mark.parametrize("args, fragment", [
    (["--prompt-ids", "1,x,3"], "--prompt-ids"),
    (["--prompt-ids", "1,99999"], "token id 99999"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["--prompt", "hi", "--top-p", "1.5"], "top_p"),
    (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    (["--prompt", "hi", "--cuda-graph-sizes", "4", "0"], "--cuda-graph-sizes"),
])
def test_bad_input_is_one_line_error(tiny_dir, args, fragment):
    proc = ringserve("generate", str(tiny_dir), *args, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringserve: error:") and fragment in lines[0]


def test_graph_flags_reach_the_engine_config():
    from server.cli import build_parser, engine_config_from

    args = build_parser().parse_args(["generate", "--prompt", "hi", "--cuda-graph-sizes", "1", "8", "--enforce-eager"])
    cfg = engine_config_from(args).resolved()
    assert cfg.cuda_graph_sizes == (1, 8) and cfg.enforce_eager
    default = engine_config_from(build_parser().parse_args(["generate", "--prompt", "hi"])).resolved()
    assert default.cuda_graph_sizes == (1, 2, 4, 8, 16, 32, 64) and not default.enforce_eager


def test_truncated_checkpoint_is_one_line_error(tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    proc = ringserve("generate", str(broken), "--prompt-ids", "1,2", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "model.safetensors" in lines[0]


def test_kv_report_of_released_v4_flash():
    proc = ringserve("kv-report", "deepseek-v4-flash", "--kv-dtype", "fp8", "--context", "1000", "--json")
    report = json.loads(proc.stdout)
    assert report["global_bytes_per_token"] == pytest.approx(3514.25)  # ≈ 3.5 KB/token (model-spec §4)
    assert report["total_bytes_at_context"] == pytest.approx(3514.25 * 1000 + report["per_sequence_bytes"])
    assert {p["name"] for p in report["pools"]} >= {"swa", "c4", "c128", "idx4"}
    text = ringserve("kv-report", "deepseek-v4-flash").stdout
    assert "3,514.25 B/token" in text


def test_kv_report_of_a_model_dir(tiny_dir):
    report = json.loads(ringserve("kv-report", str(tiny_dir), "--kv-dtype", "bf16", "--json").stdout)
    # tiny: 2 CSA layers (m=4) with 32-wide entries and 16-wide index keys, 1 HCA layer (m=8), bf16.
    assert report["global_bytes_per_token"] == pytest.approx(2 * 64 / 4 + 2 * 32 / 4 + 64 / 8)


def test_ctrl_c_during_dp_generate_stops_workers_cleanly(tiny_dir, tmp_path):
    """Ctrl-C reaches the CLI and its worker processes at once: one line, exit 130, no process
    or shared-memory ring left behind."""
    import os
    import signal
    import time

    from ipc.segment import list_segments

    prompts = tmp_path / "many.jsonl"  # minutes of work: the interrupt lands while it runs
    prompts.write_text("".join(json.dumps({"prompt_ids": [5, 6, i % 400 + 2]}) + "\n" for i in range(256)))
    cmd = [sys.executable, "-m", "server.cli", "generate", str(tiny_dir), "--dp", "2", "--prompts-file", str(prompts),
           "--max-tokens", "1000", "--ignore-eos"]
    # As from a terminal: SIGINT at its default even when this test runs as a background job
    # (whose children inherit SIGINT ignored, which the CLI rightly keeps).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            out = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "server.worker_entry"], capture_output=True, text=True)
            if len(out.stdout.split()) == 2:
                break
            time.sleep(0.2)
        time.sleep(3.0)  # the workers are past their first instructions (SIGINT ignored)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    # The last line says why; nothing else but start-up notices (e.g. orphaned rings of an
    # earlier crash being removed) may precede it, and no traceback.
    assert err.strip().splitlines()[-1] == "ringserve: interrupted" and "Traceback" not in err, err
    deadline = time.monotonic() + 10  # the workers exit once stopped
    while subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).stdout and time.monotonic() < deadline:
        time.sleep(0.1)
    left = subprocess.run(["pgrep", "-a", "-g", str(proc.pid)], capture_output=True, text=True).stdout
    assert left == "", left
    assert not [n for n in list_segments() if n.startswith(f"rsring-{proc.pid}-")]


def test_warm_kernels_serves_each_checkpoint_and_names_a_missing_one(tiny_dir, tmp_path):
    proc = ringserve("warm-kernels", str(tiny_dir))
    assert proc.stdout.startswith(f"warmed the CPU kernels of {tiny_dir} in "), proc.stdout
    missing = ringserve("warm-kernels", str(tmp_path / "nope"), check=False)
    assert missing.returncode == 2 and missing.stderr.strip() == f"ringserve: error: {tmp_path / 'nope'}: not a directory"


def test_make_model_vision_writes_a_tower_the_engine_loads(tmp_path):
    from safetensors import safe_open

    refused = ringserve("make-model", str(tmp_path / "v4"), "--vision", check=False)
    assert refused.returncode != 0 and "--vision needs --arch v41" in refused.stderr
    out = tmp_path / "v41"
    assert "with a vision tower" in ringserve("make-model", str(out), "--arch", "v41", "--vision").stdout
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"]["num_hidden_layers"] > 0
    names = set()
    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            names.update(f.keys())
    assert any(n.startswith("vision.") for n in names) and any(n.startswith("aligner.") for n in names)
    assert load_model(out, dtype=torch.float32, progress=False).encoder is not None
