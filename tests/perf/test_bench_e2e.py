"""`ringserve bench serve/sweep/gen-trace` end to end against the transformers peer server
(`perf/peer_server.py`) on a tiny random model, so this does not depend on ringserve's server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from perf.serving import cli

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def peer_url(tmp_path_factory):
    pytest.importorskip("transformers")
    model = tmp_path_factory.mktemp("tiny")
    subprocess.run([sys.executable, "-m", "server.cli", "make-model", str(model), "--preset", "tiny"], cwd=REPO,
                   check=True, capture_output=True)
    port = _free_port()
    log = (tmp_path_factory.mktemp("peerlog") / "peer.log").open("w")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(REPO / "perf" / "peer_server.py"), str(model), "--port", str(port),
                             "--threads", "1"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, "peer server exited"
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline, "peer server did not start"
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def test_serve_fixed_writes_a_complete_document(peer_url, tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = cli.main(["serve", "--url", peer_url, "--input-len", "48", "--output-len", "6", "--num-prompts", "6",
                   "--max-concurrency", "2", "--num-warmups", "1", "--ignore-eos", "--disable-tqdm",
                   "--result-file", str(out), "--save-detailed"])
    assert rc == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["completed"] == 6 and doc["failed"] == 0
    assert doc["total_output_tokens"] == 36 and doc["chunk_counts_exact"] is True
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "queue_ms", "ttft_from_ready_ms"):
        assert set(doc[key]) >= {"mean", "p50", "p90", "p99"} and doc[key]["p50"] > 0
    for key in ("output_throughput", "total_token_throughput", "request_throughput", "output_throughput_per_gpu",
                "cost_per_million_output_tokens_usd"):
        assert doc[key] > 0
    assert doc["interactivity_tok_s_per_user"]["p90"] > 0
    assert doc["peak_concurrent_requests"] <= 2
    # 48 prompt tokens each (tag included) plus the chat template's few
    assert 6 * 48 <= doc["total_input_tokens"] <= 6 * 60
    assert doc["spec_acceptance_length"] is None and doc["metrics_endpoint"] is False
    assert len(doc["requests"]) == 6


def test_agentx_and_trace_replay(peer_url, tmp_path):
    sizes = ["--turns", "2,3", "--first-turn-tokens", "64,128", "--append-tokens", "16,32", "--short-output", "2,4",
             "--long-output", "6,8", "--think-s", "0.01,0.05", "--fork-prob", "0.3"]
    out = tmp_path / "agentx.json"
    rc = cli.main(["serve", "--url", peer_url, "--workload", "agentx", "--num-sessions", "3", "--max-concurrency", "2",
                   "--ignore-eos", "--disable-tqdm", "--result-file", str(out), *sizes])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["failed"] == 0 and doc["completed"] >= 6
    assert 0.2 < doc["ideal_prefix_hit_rate"] < 1.0
    assert doc["achieved_prefix_hit_rate"] is None  # the peer has no prefix cache metrics
    assert doc["workload_params"]["turns"] == [2.0, 3.0]

    trace_file = tmp_path / "t.jsonl"
    assert cli.main(["gen-trace", "--url", "unused", "--num-sessions", "2", "--out", str(trace_file), *sizes]) == 0
    n = len(trace_file.read_text().splitlines())
    out2 = tmp_path / "trace.json"
    assert cli.main(["serve", "--url", peer_url, "--workload", "trace", "--trace", str(trace_file),
                     "--max-concurrency", "2", "--ignore-eos", "--disable-tqdm", "--result-file", str(out2)]) == 0
    doc2 = json.loads(out2.read_text())
    assert doc2["completed"] == n and doc2["ideal_prefix_hit_rate"] > 0


def test_sweep_writes_runs_and_a_png(peer_url, tmp_path):
    rc = cli.main(["sweep", "--url", peer_url, "--label", "peer", "--concurrency-start", "1", "--concurrency-end", "2",
                   "--prompts-per-concurrency", "2", "--warmups-per-concurrency", "0", "--input-len", "32",
                   "--output-len", "4", "--ignore-eos", "--disable-tqdm", "--result-dir", str(tmp_path)])
    assert rc == 0
    docs = [json.loads((tmp_path / f"peer_c{c}.json").read_text()) for c in (1, 2)]
    assert [d["max_concurrency"] for d in docs] == [1, 2] and all(d["completed"] == 2 * d["max_concurrency"] for d in docs)
    png = tmp_path / "sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert len(json.loads((tmp_path / "sweep_summary.json").read_text())) == 2


def test_unreachable_server_is_one_line_error(capsys):
    rc = cli.main(["serve", "--url", f"http://127.0.0.1:{_free_port()}", "--disable-tqdm"])
    assert rc == 2
    assert capsys.readouterr().err.startswith("ringserve bench: error: cannot list models")
