"""`ringserve bench serve --request-shape agentx` against a real `ringserve serve` (tiny random
DeepSeek-V4, DeepSeek's chat encoding, thinking on): a Weka trace written by `gen-trace` replays
with growing histories of reasoning and tool turns, and the server's usage gives the reasoning
tokens and the prefix-cache hits of later turns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from perf.serving import cli

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
from server_process import Server  # noqa: E402  (the e2e suite's real-server helper)

SIZES = ["--turns", "3,3", "--first-turn-tokens", "96,128", "--append-tokens", "8,16", "--short-output", "3,5",
         "--long-output", "6,8", "--think-s", "0,0", "--fork-prob", "0", "--tool-use-share", "0.5"]


@pytest.fixture(scope="module")
def ringserve_url(tmp_path_factory):
    model = tmp_path_factory.mktemp("agentx") / "tiny"
    subprocess.run([sys.executable, "-m", "server.cli", "make-model", str(model), "--preset", "tiny", "--seed", "3"],
                   cwd=REPO, check=True, capture_output=True, timeout=300)
    server = Server(model, "--max-num-seqs", "4", api_key=None)
    yield server.url
    assert server.stop() == 0, server.output()


def test_agentx_shape_replays_a_weka_trace(ringserve_url, tmp_path):
    trace_file = tmp_path / "t.jsonl"
    assert cli.main(["gen-trace", "--url", "unused", "--format", "weka", "--num-sessions", "2", "--out",
                     str(trace_file), *SIZES]) == 0
    out = tmp_path / "run.json"
    rc = cli.main(["serve", "--url", ringserve_url, "--workload", "trace", "--trace", str(trace_file),
                   "--request-shape", "agentx", "--max-concurrency", "2", "--ignore-eos", "--disable-tqdm",
                   "--result-file", str(out), "--save-detailed"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert (doc["completed"], doc["failed"]) == (6, 0), doc["errors"]
    assert doc["request_shape"] == "agentx" and doc["workload_params"]["format"] == "weka"
    assert doc["server_token_counts"] is True
    rows = sorted(doc["requests"], key=lambda r: (r["session_id"], r["turn"]))
    # ignore_eos + max_completion_tokens: every reply has its recorded length; thinking mode, so the random
    # model's text is reasoning until it happens to sample the end-of-reasoning token
    trace_outs = [r["out"] for line in trace_file.read_text().splitlines() for r in json.loads(line)["requests"]]
    assert sorted(r["output_tokens"] for r in rows) == sorted(trace_outs)
    assert all(0 <= r["reasoning_tokens"] <= r["output_tokens"] for r in rows)
    assert doc["total_reasoning_tokens"] > 0
    for a, b in zip(rows, rows[1:]):
        if a["session_id"] == b["session_id"]:
            assert b["input_tokens"] > a["input_tokens"]  # the history grows
    assert all(r["cached_tokens"] == 0 for r in rows if r["turn"] == 0)
    assert doc["usage_prefix_hit_rate_later_turns"] > 0  # later turns hit the prefix cache
