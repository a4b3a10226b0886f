"""Multi-turn rollouts end to end: client → broker → node → (bridge →) model, in real processes."""

from __future__ import annotations

import re
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.agent import ChatTokens, Trajectory
from prorl_cli.protocol import JobResult
from tests.harness import Deployment
from tests.inference.conftest import RecordingProxy, start_bridge

SAMPLING = {"max_tokens": 12, "temperature": 1.0, "seed": 11}


def f32(x: float) -> float:
    """``x`` as it travels in a float32 payload frame."""
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def run_jobs(d: Deployment, tiny_model: Path, n: int, turns: int = 3, **instance: Any) -> list[JobResult]:
    inst = {"tokenizer": str(tiny_model), "turns": turns, **instance}
    ids = d.client.submit("multiturn", [inst] * n, sampling=SAMPLING, timeout_s=240)
    return d.client.wait(ids, timeout_s=300)


def check_token_exact(res: JobResult, chat: ChatTokens, turns: int) -> Trajectory:
    """Every call's prompt is exactly the previous prompt + output + the observation's ids."""
    assert res.ok, (res.state, res.error)
    traj = Trajectory.from_dict(res.output["trajectory"])
    assert traj.error is None and traj.token_exact and len(traj.calls) == turns
    assert traj.calls[0].prompt_ids == chat.initial_prompt([{"role": "user", "content": f"job {res.job_id}"}])
    for k in range(1, turns):
        prev, call, delta = traj.calls[k - 1], traj.calls[k], res.output["deltas"][k - 1]
        assert call.prompt_ids == prev.prompt_ids + prev.output_ids + delta
        obs = {"role": "tool", "content": f"result {k - 1}: having 2+3=5"}
        assert delta == chat.continuation(prev.output_ids, [obs])
    last = traj.calls[-1]
    assert traj.sequence_ids == last.prompt_ids + last.output_ids
    assert sum(traj.loss_mask) == sum(len(c.output_ids) for c in traj.calls)
    return traj


@pytest.mark.vllm
def test_rollout_through_bridge_to_vllm_is_token_exact(
    deployment: Deployment, recording_proxy: RecordingProxy, tiny_model: Path, chat: ChatTokens
) -> None:
    start_bridge(deployment, "b-vllm", "--attach", recording_proxy.url)
    results = run_jobs(deployment, tiny_model, n=4)
    for res in results:
        traj = check_token_exact(res, chat, turns=3)
        for call in traj.calls:
            assert call.backend_id == "b-vllm"
            answer = recording_proxy.answer_for(call.prompt_ids)["choices"][0]
            assert call.output_ids == answer["token_ids"]
            assert call.logprobs == [f32(x) for x in answer["logprobs"]["token_logprobs"]]
            assert call.finish_reason == answer["finish_reason"]


@pytest.mark.vllm
def test_rollout_through_http_backend_added_by_url(
    deployment: Deployment, recording_proxy: RecordingProxy, tiny_model: Path, chat: ChatTokens
) -> None:
    status = deployment.client.add_backend(recording_proxy.url)
    assert status.kind == "http"
    results = run_jobs(deployment, tiny_model, n=3)
    for res in results:
        traj = check_token_exact(res, chat, turns=3)
        for call in traj.calls:
            assert call.backend_id == status.backend_id  # the node called it directly
            answer = recording_proxy.answer_for(call.prompt_ids)["choices"][0]
            assert call.output_ids == answer["token_ids"]
            # Direct HTTP: no float32 frame on the way, the JSON value itself.
            assert call.logprobs == answer["logprobs"]["token_logprobs"]
    # The nodes report each direct call back, so the broker's counts hold for HTTP backends too.
    calls = sum(len(res.output["trajectory"]["calls"]) for res in results)
    st = deployment.wait_for(
        lambda st: any(b.backend_id == status.backend_id and b.served == calls for b in st.backends),
        10, "served calls of the HTTP backend to be counted",
    )
    (http,) = [b for b in st.backends if b.backend_id == status.backend_id]
    assert http.inflight == 0 and http.jobs == 0


def test_rollout_through_transformers_engine(deployment: Deployment, tiny_model: Path, chat: ChatTokens) -> None:
    start_bridge(deployment, "b-tf", "--engine", "transformers", "--model", str(tiny_model))
    results = run_jobs(deployment, tiny_model, n=2)
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    for res in results:
        traj = check_token_exact(res, chat, turns=3)
        last = traj.calls[-1]
        # The log-probs are the model's own: one teacher-forced pass over the whole sequence agrees.
        with torch.inference_mode():
            lp = torch.log_softmax(model(input_ids=torch.tensor([traj.sequence_ids])).logits[0].float(), -1)
        expected = [float(lp[i - 1, t]) for i, (t, m) in enumerate(zip(traj.sequence_ids, traj.loss_mask, strict=True)) if m]
        got = [x for x, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m]
        assert got == pytest.approx(expected, abs=1e-4)
        assert {c.backend_id for c in traj.calls} == {"b-tf"} and last.finish_reason in ("length", "stop")


def test_generate_errors_reach_the_trajectory(deployment: Deployment, tiny_model: Path) -> None:
    """A request the server refuses (context too long) fails that call with the server's message."""
    start_bridge(deployment, "b-tf", "--engine", "transformers", "--model", str(tiny_model), "--max-model-len", "64")
    (res,) = run_jobs(deployment, tiny_model, n=1, turns=3)
    traj = Trajectory.from_dict(res.output["trajectory"])
    assert traj.stop_reason == "error" and traj.error is not None
    assert "backend b-tf" in traj.error["message"] and "maximum context length is 64" in traj.error["message"]
    # Typed across bridge, broker and node: an agent (or the gateway) can tell "shorten the prompt" from a failure.
    assert traj.error["type"] == "BackendContextLengthExceeded"


def test_bridge_joins_an_encrypted_broker(tmp_path: Path, tiny_model: Path, chat: ChatTokens) -> None:
    """With CURVE on, the bridge authenticates with the deployment's client key like every peer."""
    from tests.inference.conftest import HANDLERS

    d = Deployment(tmp_path / "home", config={"broker": {"curve": "on"}})
    try:
        d.start_broker()
        assert d.client.status() is not None
        from prorl_cli.rendezvous import read_rendezvous

        assert read_rendezvous(d.deployment_dir).curve_public_key
        d.start_node("n1", "--handlers", str(HANDLERS))
        start_bridge(d, "b-tf", "--engine", "transformers", "--model", str(tiny_model))
        (res,) = run_jobs(d, tiny_model, n=1, turns=2)
        check_token_exact(res, chat, turns=2)
    finally:
        d.close()


def test_silent_bridge_is_dropped_and_its_call_runs_again_on_the_other(
    deployment: Deployment, tiny_model: Path, chat: ChatTokens
) -> None:
    """A bridge killed with SIGKILL cannot unregister: the broker drops it when its heartbeats stop, and the call
    it was serving runs again on the other bridge (once: a second loss under it would fail it), so no job fails."""
    from tests.inference.conftest import kill_group

    d = deployment
    start_bridge(d, "b-keep", "--engine", "transformers", "--model", str(tiny_model))
    doomed = start_bridge(d, "b-doomed", "--engine", "transformers", "--model", str(tiny_model))
    inst = {"tokenizer": str(tiny_model), "turns": 2}
    ids = d.client.submit("multiturn", [inst] * 2, sampling={"max_tokens": 300, "temperature": 1.0}, timeout_s=240)
    d.wait_for(lambda st: any(b.backend_id == "b-doomed" and b.inflight > 0 for b in st.backends),
               60, "a call in flight on b-doomed", "b-doomed")
    kill_group(doomed)
    results = d.client.wait(ids, timeout_s=240)
    assert [r.state for r in results] == ["done", "done"], [r.error for r in results]
    trajs = [Trajectory.from_dict(r.output["trajectory"]) for r in results]
    assert [t.error for t in trajs] == [None, None]
    assert all(t.calls and t.calls[-1].backend_id == "b-keep" for t in trajs), \
        [[c.backend_id for c in t.calls] for t in trajs]
    st = d.client.status()
    assert [b.backend_id for b in st.backends] == ["b-keep"]
    assert [(b.backend_id, (b.gone_reason or "")[:10]) for b in st.gone_backends] == [("b-doomed", "silent for")]
    assert "backend b-doomed lost: silent for" in d.log("broker") and "go to other backends (each once)" in d.log("broker")


def test_sigterm_unregisters_the_bridge(deployment: Deployment, tiny_model: Path) -> None:
    import signal

    d = deployment
    proc = start_bridge(d, "b-tf", "--engine", "transformers", "--model", str(tiny_model))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    d.wait_for(lambda st: not st.backends, 30, "b-tf to be gone")
    assert "backend b-tf left" in d.log("broker")  # a planned exit, not a loss


@pytest.mark.parametrize("moved", [False, True], ids=["same-port", "new-port"])
def test_a_restarted_broker_gets_its_node_and_bridge_back(
    tmp_path: Path, tiny_model: Path, chat: ChatTokens, moved: bool
) -> None:
    """Node and bridge register again on their own when the broker comes back after a crash, on its old port or
    a new one (found in the rendezvous file); a call lost with the old broker is asked again of the new one."""
    import yaml

    from tests.harness import fixed_port
    from tests.inference.conftest import HANDLERS

    d = Deployment(tmp_path / "home", config={"broker": {"port": fixed_port()}})
    try:
        d.start_broker()
        d.start_node("n1", "--handlers", str(HANDLERS))
        start_bridge(d, "b-tf", "--engine", "transformers", "--model", str(tiny_model))
        # A job whose first call is held at the broker when the broker dies.
        d.client.pause_generation()
        (job,) = d.client.submit("multiturn", [{"tokenizer": str(tiny_model), "turns": 2}], sampling=SAMPLING, timeout_s=240)
        d.wait_for(lambda st: st.held_generates == 1, 60, "the first call to be held", "n1")
        old_address = d.address
        d.kill("broker")
        if moved:
            d.config_path.write_text(yaml.safe_dump({**d.config, "broker": {"port": fixed_port()}}))
        d.start_broker()
        assert (d.address != old_address) == moved
        if moved:
            d.drop_client()  # the test's client was given the old address; the next one reads the new
        d.wait_for(lambda st: [n.node_id for n in st.nodes if n.alive] == ["n1"], 60, "n1 to register again", "n1")
        d.wait_for(lambda st: [b.backend_id for b in st.backends if b.alive] == ["b-tf"], 60,
                   "b-tf to register again", "b-tf")
        assert "registering again" in d.log("n1") and "registering again" in d.log("b-tf")
        assert ("bridge follows it" in d.log("b-tf")) == moved
        # The node claimed the job, asked the new broker again for the lost call, and the client was told the result.
        (res,) = d.client.wait([job], timeout_s=240)
        check_token_exact(res, chat, turns=2)
        assert res.attempt == 1 and "asking again" in d.log("n1")
        (res,) = run_jobs(d, tiny_model, n=1, turns=2)
        check_token_exact(res, chat, turns=2)
    finally:
        d.close()


def _wait_text(path: Path, text: str | tuple[str, ...], timeout_s: float = 60.0, start: int = 0) -> str:
    """Wait until the log at ``path`` holds ``text`` (one of them, given several) after byte ``start`` (a child's
    log is the only witness of what happened in it)."""
    import time

    texts = (text,) if isinstance(text, str) else text
    deadline = time.monotonic() + timeout_s
    while not any(t in (log := path.read_bytes()[start:].decode(errors="replace") if path.exists() else "")
                  for t in texts):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} never said {' or '.join(map(repr, texts))}:\n{log[-3000:]}")
        time.sleep(0.05)
    return log


LONG_CALL = {"max_tokens": 2000, "ignore_eos": True, "temperature": 1.0, "seed": 3}


def test_cancelling_a_job_stops_its_call_in_the_engine(deployment: Deployment, tiny_model: Path) -> None:
    """The broker tells the bridge; the transformers engine stops before its next token; the engine is free again."""
    d = deployment
    start_bridge(d, "b-tf", "--engine", "transformers", "--model", str(tiny_model))
    (job,) = d.client.submit("onecall", [{"prompt_ids": [5, 6, 7]}], sampling=LONG_CALL, timeout_s=240)
    d.wait_for(lambda st: any(b.inflight == 1 for b in st.backends), 60, "the call to be in flight", "b-tf")
    assert d.client.cancel([job]) == {job: "cancelled"}
    (res,) = d.client.wait([job], timeout_s=60)
    assert res.state == "cancelled"
    # The cancel may reach the bridge before the call entered the engine (the broker counts a call in flight
    # from the moment it routed it): then the bridge drops it and the engine never sees it. Either way the
    # call must not run to its 2000 tokens.
    log = _wait_text(d.logs / "b-tf.log", f"generate for job {job} cancelled")
    if f"generate for job {job} cancelled before it reached the engine" in log:
        assert "generation cancelled" not in log  # nothing was submitted, so nothing there to cancel
    else:
        assert f"generate for job {job} cancelled in the engine: the job ended" in log
        log = _wait_text(d.logs / "b-tf.log", "generation cancelled")  # "after N of at most 2000 tokens" / "before it started"
        stopped = re.search(r"generation cancelled after (\d+) of at most 2000 tokens", log)
        assert stopped is None or int(stopped.group(1)) < 2000, stopped.group(0)
    (b,) = d.client.status().backends
    assert (b.inflight, b.jobs) == (0, 0)
    # The engine's one worker thread is free: the next call runs to its full length.
    (short,) = d.client.submit("onecall", [{"prompt_ids": [5, 6, 7]}], sampling={**LONG_CALL, "max_tokens": 8})
    (res2,) = d.client.wait([short], timeout_s=120)
    assert res2.ok and len(res2.output["output_ids"]) == 8 and res2.output["finish_reason"] == "length"


@pytest.mark.vllm
def test_cancelling_a_job_aborts_its_request_in_vllm(tmp_path: Path, vllm_server: Any) -> None:
    """The bridge drops its HTTP request, and vLLM aborts the request (its own log says so)."""
    # vLLM on the CPU takes every core while it writes: with the tests' 2 s of heartbeats the bridge takes a
    # loaded machine's late ones for a silent broker and registers again mid-call. Heartbeats are not what
    # this test is about; 15 s of them (60 x 0.25 s) keep the one connection it needs.
    from tests.inference.conftest import HANDLERS

    d = Deployment(tmp_path / "home", config={"broker": {"heartbeat_liveness": 60},
                                              "inference": {"generate_timeout_s": 120.0}})
    try:
        d.start_broker()
        d.start_node("n1", "--handlers", str(HANDLERS))
        start_bridge(d, "b-vllm", "--attach", vllm_server.url)
        _abort_in_vllm(d, vllm_server)
    finally:
        d.close()


def _abort_in_vllm(d: Deployment, vllm_server: Any) -> None:
    # vLLM on the CPU writes the tiny model's longest call (1,000 tokens) in about a second: on a loaded
    # machine the call can end before the cancel reaches the bridge, which proves nothing either way.
    # Such a lost race is told by the job's own end (done, not cancelled), or, when the cancel crossed the call's
    # reply on its way, by the bridge's log (the call ended there before the cancel came); then try again. So is a
    # bridge that took the broker for silent meanwhile (heartbeats late on a loaded machine) and registered again:
    # the broker may have taken it for lost too and moved its call, and the cancel then no longer names this request.
    bridge_log = d.logs / "b-vllm.log"
    for _ in range(10):
        start = vllm_server.log_path.stat().st_size
        bridge_start = bridge_log.stat().st_size
        (job,) = d.client.submit("onecall", [{"prompt_ids": [5, 6, 7]}], sampling={**LONG_CALL, "max_tokens": 1000},
                                 timeout_s=240)
        # Cancel once vLLM is working on it (a request closed before vLLM read it never starts there at all).
        _wait_text(vllm_server.log_path, "Added request", start=start)
        d.client.cancel([job])
        (res,) = d.client.wait([job], timeout_s=60)
        if res.state == "done" or b"registering again" in bridge_log.read_bytes()[bridge_start:]:
            continue
        assert res.state == "cancelled", (res.state, res.error)
        aborted = f"generate for job {job} cancelled in the engine: the job ended"
        crossed = f"generate for job {job} cancelled after it ended here"
        if aborted not in _wait_text(bridge_log, (aborted, crossed), start=bridge_start):
            continue
        _wait_text(vllm_server.log_path, "Aborted request", start=start)
        return
    pytest.fail("every 1,000-token call ended before its cancel arrived: ten lost races")


def test_a_call_held_past_the_generate_timeout_is_served_after_resume(tmp_path: Path, tiny_model: Path) -> None:
    """Time a call spends held at the broker (paused generation) does not count against the node's generate timeout."""
    from tests.inference.conftest import HANDLERS

    d = Deployment(tmp_path / "home", config={"inference": {"generate_timeout_s": 2.0}})
    try:
        d.start_broker()
        d.start_node("n1", "--handlers", str(HANDLERS))
        start_bridge(d, "b-tf", "--engine", "transformers", "--model", str(tiny_model))
        d.client.pause_generation()
        (job,) = d.client.submit("onecall", [{"prompt_ids": [5, 6, 7], "eval_call": True}],
                                 sampling={"max_tokens": 4, "seed": 1}, timeout_s=120)
        d.wait_for(lambda st: st.held_generates == 1, 60, "RUN's call to be held", "n1")
        time.sleep(3.0)  # the pause itself (what is tested): it outlasts generate_timeout_s
        assert d.client.status().held_generates == 1, "the node gave up on a call that was only held"
        d.client.resume_generation()
        (res,) = d.client.wait([job], timeout_s=120)
        assert res.ok and "error" not in res.output, res.output
        assert len(res.output["eval"]["output_ids"]) == 4
        (b,) = d.client.status().backends
        assert b.served == 2, "both the held RUN call and EVAL's call are served"
    finally:
        d.close()
