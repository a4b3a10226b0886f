"""`prorl inspect` on a job of several conversations (a main agent and a sub-agent through the gateway): each call's
new prompt tokens are counted against the previous call of its own conversation, and each call names its agent
and conversation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from prorl_cli.observe.inspect import call_views, trajectory_of, violations
from prorl_cli.observe.results import load_results


def _call(prompt: list[int], output: list[int], segment: int, agent: str | None, text: str,
          prefix_ok: bool = True) -> dict[str, Any]:
    return {"prompt_ids": prompt, "output_ids": output, "logprobs": [-0.5] * len(output), "finish_reason": "stop",
            "text": text, "segment": segment, "agent": agent, "prefix_ok": prefix_ok}


#: Calls as the gateway records them: lead (conversation 0) and helper (conversation 1) interleaved, each extending
#: its own conversation token-exactly, but for an edit of helper's history (call 2), which opened conversation 2.
CALLS = [
    {**_call([1, 2], [3], 0, "lead", "plan</plan>"), "stop_string": "</plan>"},
    _call([7], [8], 1, "helper", "look"),
    _call([7, 6], [11], 2, "helper", "again", prefix_ok=False),
    _call([1, 2, 3, 4], [5], 0, "lead", "act"),
    _call([7, 8, 9, 9], [10], 1, "helper", "found"),
]
#: The messages of the last call's conversation (the gateway keeps those): helper's observation after its first turn.
MESSAGES = [{"role": "user", "content": "look"}, {"role": "assistant", "content": "look"},
            {"role": "tool", "name": "grep", "content": "hit"}, {"role": "assistant", "content": "found"}]


def _results_file(tmp_path: Path, violations_listed: bool) -> Path:
    traj = {"calls": CALLS, "messages": MESSAGES, "stop_reason": "stop",
            "violations": [{"call": 2, "segment": 2, "reason": "edited", "message": "call 2: new segment 2: edited"}]
            if violations_listed else []}
    row = {"job_id": "multi-0-0", "task": "harness", "state": "done", "reward": 1.0, "output": {"trajectory": traj}}
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path


def test_new_prompt_tokens_are_counted_against_the_previous_call_of_the_same_conversation(tmp_path: Path) -> None:
    (result,) = load_results(_results_file(tmp_path, violations_listed=True))
    traj = trajectory_of(result)
    assert traj is not None
    views = call_views(traj)
    assert [v.new_prompt_ids for v in views] == [[1, 2], [7], [7, 6], [4], [9, 9]]
    assert [(v.agent, v.segment) for v in views] == [("lead", 0), ("helper", 1), ("helper", 2), ("lead", 0),
                                                    ("helper", 1)]
    # The observation after helper's first turn follows that call, not the job's first call (lead's).
    assert [[o["content"] for o in v.observations] for v in views] == [[], ["hit"], [], [], []]
    # `prorl report`'s trajectory view labels its calls the same way.
    from prorl_cli.observe.report import _job_section

    assert "<h4>call 3 · agent lead, conversation 0</h4>" in _job_section(result)
    # The stop string that ended a call is named with its finish reason (a record without one shows the reason).
    assert [v.finish for v in views] == ['stop at "</plan>"'] + ["stop"] * 4
    assert "finish stop at &quot;&lt;/plan&gt;&quot;" in _job_section(result)

def test_a_call_sampled_under_a_constraint_or_after_discarded_turns_says_so(tmp_path: Path) -> None:
    """A constrained call's log-probs are the masked distribution's (a forced token's is 0): inspect and report say
    so, and say which turns the gateway discarded before it; a plain call gets no note."""
    calls = [{**_call([1], [2], 0, None, "x"), "tool_choice_retries": 2, "tool_choice_unmet": True},
             {**_call([1, 2, 3], [4], 0, None, '{"a": 1}'), "structured": {"json": {"type": "object"}},
              "format_retried": True},
             _call([1, 2, 3, 4, 5], [6], 0, None, "y")]
    row = {"job_id": "j", "task": "harness", "state": "done", "output": {"trajectory": {"calls": calls}}}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (result,) = load_results(path)
    traj = trajectory_of(result)
    assert traj is not None
    notes = [v.sampling_notes for v in call_views(traj)]
    assert notes == [["2 turns discarded first for tool_choice",
                      "no turn honoured tool_choice: this is the last, as generated"],
                     ["constrained (json): log-probs of the masked distribution",
                      "a free answer outside the request's format was discarded first"], []]
    from prorl_cli.observe.report import _job_section

    assert " · constrained (json): log-probs of the masked distribution" in _job_section(result)
    shown = subprocess.run([sys.executable, "-m", "prorl_cli", "inspect", str(path)], capture_output=True, text=True,
                           env={"PATH": "", "COLUMNS": "200", "PRORL_HOME": str(tmp_path / "home")}, timeout=120,
                           cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "constrained (json): log-probs of the masked distribution" in shown.stdout, shown.stdout


def test_an_unlisted_broken_call_is_named_against_its_own_conversation(tmp_path: Path) -> None:
    calls = [CALLS[0], CALLS[1], {**CALLS[3], "prompt_ids": [1, 9], "prefix_ok": False},
             _call([5], [6], 3, "other", "x", prefix_ok=False)]
    row = {"job_id": "j", "task": "t", "state": "done", "output": {"trajectory": {"calls": calls}}}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (result,) = load_results(path)
    assert [v["message"] for v in violations(result)] == [
        "call 2: prompt is not a token-exact extension of call 0 (its conversation's previous call)",
        "call 3: prompt marked not token-exact, the first call of conversation 3",
    ]


def test_inspect_names_each_calls_agent_and_conversation(tmp_path: Path) -> None:
    path = _results_file(tmp_path, violations_listed=True)
    out = subprocess.run([sys.executable, "-m", "prorl_cli", "inspect", str(path)], capture_output=True, text=True,
                         env={"PATH": "", "COLUMNS": "200", "PRORL_HOME": str(tmp_path / "home")}, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    heads = [line for line in out.stdout.splitlines() if " call " in line and " ids " in line]
    assert len(heads) == 5, out.stdout
    assert "call 0  agent lead, conversation 0 " in heads[0] and "(+2 new)" in heads[0], heads[0]
    assert 'finish stop at "</plan>"  prompt 2 ids' in heads[0], heads[0]
    assert "call 2  agent helper, conversation 2 " in heads[2] and "CONTINUITY BROKEN" in heads[2], heads[2]
    assert "call 3  agent lead, conversation 0 " in heads[3] and "(+1 new)" in heads[3], heads[3]
    assert "call 4  agent helper, conversation 1 " in heads[4] and "(+2 new)" in heads[4], heads[4]
