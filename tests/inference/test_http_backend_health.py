"""An HTTP backend that keeps failing calls rests: new calls go to the others (real broker and node; the servers
stand in at the HTTP boundary)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from prorl_cli.broker.backends import FAULTS_TO_REST, REST_FIRST_S, REST_MAX_S, Backend
from tests.harness import Deployment
from tests.inference.conftest import LocalHttpServer


class CompletionServer(LocalHttpServer):
    """Lists one model; answers every completion with ``status`` (200: two tokens), counting them."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.completions = 0
        super().__init__()

    async def respond(self, method: str, path: str, body: Any) -> tuple[int, bytes]:
        if method == "GET" and path == "/v1/models":
            return 200, json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
        if method == "POST" and path == "/v1/completions":
            self.completions += 1
            if self.status != 200:
                # As nginx answers for a dead vLLM behind it: a page longer than any header field (padded).
                page = "<html><head><title>503 Service Unavailable</title></head><body>" + "<!-- pad -->" * 60
                return self.status, page.encode()
            choice = {"index": 0, "token_ids": [7, 8], "logprobs": {"token_logprobs": [-0.5, -0.25]},
                      "finish_reason": "length"}
            return 200, json.dumps({"choices": [choice]}).encode()
        return 404, json.dumps({"error": {"message": f"no {path}"}}).encode()


@pytest.fixture
def servers() -> Iterator[tuple[CompletionServer, CompletionServer]]:
    broken, good = CompletionServer(503), CompletionServer(200)
    try:
        yield broken, good
    finally:
        broken.close()
        good.close()


def test_a_backend_failing_calls_in_a_row_rests_and_new_calls_go_to_the_other(
    deployment: Deployment, servers: tuple[CompletionServer, CompletionServer]
) -> None:
    """Both backends idle, the broken one (503 on every completion) is picked first, and without rest it was
    picked for every job: it never serves, so it stays the least loaded. It fails exactly FAULTS_TO_REST jobs,
    one at a time; the jobs after them all run on the good one, and status says why the broken one rests."""
    broken, good = servers
    client = deployment.client
    broken_id = client.add_backend(broken.url).backend_id
    good_id = client.add_backend(good.url).backend_id
    served_by = []
    for _ in range(FAULTS_TO_REST + 3):
        (job,) = client.submit("onecall", [{"prompt_ids": [1, 2, 3]}], sampling={"max_tokens": 2}, timeout_s=60)
        (result,) = client.wait([job], timeout_s=90)
        # The handler keeps a failed call's error as its output (the job itself is done).
        error = result.output.get("error", "")
        served_by.append(result.output.get("backend_id") or error[:error.find("HTTP 503") + 8])
    assert served_by == [f"backend {broken.url}: HTTP 503"] * FAULTS_TO_REST + [good_id] * 3, served_by
    assert broken.completions == FAULTS_TO_REST and good.completions == 3
    by_id = {b.backend_id: b for b in client.status().backends}
    assert 0 < by_id[broken_id].resting_s <= REST_FIRST_S and "HTTP 503" in (by_id[broken_id].last_fault or "")
    assert by_id[good_id].resting_s == 0 and by_id[good_id].last_fault is None
    assert f"backend {broken_id} failed {FAULTS_TO_REST} calls in a row" in deployment.log("broker")
    shown = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", deployment.name, "backends", "list"],
                           env=deployment.env(), capture_output=True, text=True, timeout=120)
    assert "resting" in shown.stdout and "HTTP 503" in shown.stdout, shown.stdout + shown.stderr


def test_a_rest_answers_one_outage_and_each_failed_probe_doubles_it() -> None:
    b = Backend("http://h/v1", "http")
    # Eight calls in flight when the server died: the first faults start a rest, the others are the same outage.
    rests = [b.note_fault("refused", 100.0, routed_at=90.0) for _ in range(8)]
    assert rests == [None] * (FAULTS_TO_REST - 1) + [REST_FIRST_S] + [None] * (8 - FAULTS_TO_REST), rests
    assert b.avoided(100.0, inflight=0) and not b.avoided(100.0 + REST_FIRST_S, inflight=0)
    assert b.avoided(100.0 + REST_FIRST_S, inflight=1), "one probe at a time once the rest is over"
    probes = [b.note_fault("refused", t, routed_at=t) for t in (200.0, 300.0, 400.0, 500.0, 600.0, 700.0)]
    assert probes == [2 * REST_FIRST_S, 4 * REST_FIRST_S, 8 * REST_FIRST_S, 16 * REST_FIRST_S, REST_MAX_S, REST_MAX_S]
    assert b.status(0, 700.0).resting_s == REST_MAX_S and b.status(0, 700.0 + REST_MAX_S).resting_s == 0
    assert b.note_answer() is True and b.status(0, 700.0).resting_s == 0 and b.last_fault is None
    assert not b.avoided(700.0, inflight=5) and b.note_answer() is False
