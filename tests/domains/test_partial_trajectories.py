"""Every agent handler keeps its partial trajectory and ends the same way when RUN is cut short.

The four domains and ``math_agent`` run on the shared scripted stack (real
broker, node, Apptainer sandboxes, scripted model behind a real bridge). In
each, the model's first turn calls a tool, then:

- its second call outlasts the handler's RUN limit (instance setting
  ``run_timeout_s``): the job is ``timed_out`` (never ``failed``), with the
  first call in ``output["trajectory"]`` and ``stop_reason`` ``timeout``;
- or its second call raises (``tests/domains/failing_handlers.py``): the job
  is ``failed``, with the first call kept and ``stop_reason`` ``error``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prorl_cli.domains.tinyrepo import make_tinyrepo
from tests.domains.conftest import ScriptedStack, turn

RUN_LIMIT_S = 20.0  # the first call and its tool finish well within it; the second call sleeps far past it


def _cases(tmp_path: Path, domain_image: str) -> dict[str, tuple[dict[str, Any], str]]:
    """Per task: an instance (``{tag}`` marks where the script key goes) and the tool-calling first turn."""
    swe = make_tinyrepo(tmp_path / "tinycalc")
    return {
        "math": ({"problem": "{tag}", "answer": "2"}, turn("", ("python", {"code": "1+1"}))),
        "code": ({"question": "{tag}", "tests": [{"input": "", "output": "2\n"}]},
                 turn("", ("bash", {"command": "echo 2"}))),
        "search": ({"question": "{tag}", "answers": ["Koechlin"]}, turn("", ("search", {"query": "Eiffel"}))),
        "math_agent": ({"question": "{tag}", "answer": "2"}, turn("", ("calculator", {"expression": "1+1"}))),
        "swe": ({**swe.instance, "problem_statement": "{tag}", "repo_path": str(swe.path)}, turn("", ("bash", {"command": "ls /testbed"}))),
    }


def _with(instance: dict[str, Any], tag: str, **settings: Any) -> dict[str, Any]:
    out = {k: (v.replace("{tag}", tag) if isinstance(v, str) else v) for k, v in instance.items()}
    out["settings"] = {**out.get("settings", {}), **settings}
    return out


def test_run_limit_times_out_and_run_failure_fails_with_the_partial_trajectory(
    stack: ScriptedStack, tmp_path: Path, domain_image: str
) -> None:
    cases = _cases(tmp_path, domain_image)
    jobs: list[tuple[str, str, dict[str, Any]]] = []
    for task, (instance, first) in cases.items():
        stack.add(f"[P-{task}-slow]", first, "<<sleep:300>>never read")
        stack.add(f"[P-{task}-fail]", first, "never asked for")
        # The *_failing variants have no domains.<task> in prorl.yaml: the image comes with the instance.
        jobs.append((task, "slow", _with(instance, f"[P-{task}-slow]", image=domain_image, run_timeout_s=RUN_LIMIT_S)))
        jobs.append((f"{task}_failing", "fail", _with(instance, f"[P-{task}-fail]", image=domain_image)))
    stack.start_model()
    client = stack.d.client
    ids = [client.submit(task, [inst], timeout_s=200)[0] for task, _, inst in jobs]
    by_id = {r.job_id: r for r in client.wait(ids, timeout_s=300)}

    for (task, kind, _), job_id in zip(jobs, ids, strict=True):
        r = by_id[job_id]
        out = r.output
        traj = out.get("trajectory")
        assert isinstance(traj, dict), (task, kind, r)
        assert len(traj["calls"]) == 1, (task, kind, traj["calls"])  # the tool-calling turn, kept
        assert any(m["role"] == "tool" for m in traj["messages"]), (task, kind, traj["messages"])
        assert r.critical_error == "run" and r.reward == 0.0, (task, kind, r)
        if kind == "slow":
            assert r.state == "timed_out", (task, r.state, r.error)
            assert traj["stop_reason"] == out["stop_reason"] == "timeout", (task, traj["stop_reason"])
            assert r.error["type"] == "StageTimeout" and f"{RUN_LIMIT_S:.3f}" in r.error["message"], r.error
            assert "handler's run limit" in r.error["message"], r.error
        else:
            assert r.state == "failed", (task, r.state, r.error)
            assert traj["stop_reason"] == out["stop_reason"] == "error", (task, traj["stop_reason"])
            assert out["failure"] == {"stage": "run", "type": "RuntimeError",
                                      "message": "the model client fell over on call 2"}, out["failure"]


def test_a_job_cancelled_mid_call_keeps_the_calls_it_made(stack: ScriptedStack) -> None:
    """A cancel while the second model call is in flight: the result is the node's, with the first call kept."""
    first = turn("", ("calculator", {"expression": "1+1"}))
    stack.add("[P-cancel]", first, "<<sleep:300>>never read")
    stack.start_model()
    client = stack.d.client
    served = sum(b.served for b in client.status().backends)
    (job_id,) = client.submit("math_agent", [{"question": "[P-cancel]", "answer": "2"}], timeout_s=200)
    # The first call answered and the second one held at the model: the job is mid-call.
    stack.d.wait_for(lambda st: sum(b.served for b in st.backends) > served and sum(b.inflight for b in st.backends) > 0,
                     60, "the second model call to be in flight")
    assert client.cancel([job_id]) == {job_id: "cancelled"}
    (r,) = client.wait([job_id], timeout_s=60)
    assert r.state == "cancelled", r
    traj = r.output["trajectory"]
    assert len(traj["calls"]) == 1 and any(m["role"] == "tool" for m in traj["messages"]), traj
    assert traj["stop_reason"] == "cancelled", traj["stop_reason"]
