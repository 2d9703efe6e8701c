"""Fuzz the HTTP API from its own OpenAPI description with schemathesis: no 5xx, ever.

Bounded for CI (`FUZZ_EXAMPLES` cases per operation, default 25). Valid and invalid inputs are
both generated; every answer must be a 2xx/4xx with a JSON body (streams aside)."""

from __future__ import annotations

import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from server_process import Server  # noqa: E402

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def fuzz_server(model_dir):
    s = Server(model_dir, "--max-num-seqs", "8", "--max-queued-requests", "64", "--request-timeout", "20")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json",
                                         headers={"Authorization": f"Bearer {fuzz_server.api_key}"})


def _operations(schema) -> list:
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_server_errors(api_schema, fuzz_server, mode):
    """Every operation, valid (positive) and invalid (negative) inputs: 2xx/4xx only."""
    from hypothesis import given
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    strategies = [op.as_strategy(generation_mode=generation) for op in _operations(api_schema)]
    headers = {"Authorization": f"Bearer {fuzz_server.api_key}"}
    seen = {"cases": 0}

    @given(st.one_of(strategies))
    @settings(max_examples=EXAMPLES * len(strategies), deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True)
    def check(case):
        body = case.body if isinstance(case.body, dict) else None
        if body is not None and case.path.startswith("/v1/"):
            # keep generation short; the fuzzing is about parsing
            if case.path.startswith("/v1/responses"):
                body["max_output_tokens"] = 4
            else:
                body["max_tokens"] = 4
                body.pop("max_completion_tokens", None)
            body.pop("stream", None)
        response = case.call(base_url=fuzz_server.url, headers=headers, timeout=60)
        seen["cases"] += 1
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])
        if response.status_code >= 400 and response.content:
            assert "error" in response.json()

    check()
    assert seen["cases"] >= EXAMPLES
    print(f"schemathesis {mode}: {seen['cases']} cases, no 5xx")
