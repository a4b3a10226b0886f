"""``prorl plan``: the capacity planner's simulation, its workload readers and its command line.

Everything here runs on the simulated clock: no processes, no sleeps, no timing assertions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from prorl_cli.cli import cli
from prorl_cli.inference.sim_engine import PROFILES_DIR, SimEngine, SimProfile
from prorl_cli.planning import (
    RULE,
    RULE_NO_SIGNAL,
    Call,
    ClusterShape,
    PlanError,
    Prediction,
    RolloutShape,
    Workload,
    make_plan,
    recommend,
    simulate,
)
from prorl_cli.protocol import JobResult

#: A small SWE-like workload (sim_agent's fields), quick to simulate.
SMALL = {
    "turns": [3, 6], "prompt_tokens": 1000,
    "output_tokens": {"median": 80, "sigma": 0.5, "max": 400},
    "observation_tokens": {"median": 300, "sigma": 0.8, "max": 2000},
    "tool_s": {"median": 1.0, "sigma": 0.8, "max": 20},
    "p_solve": [0.0, 0.3, 0.5, 1.0],
}


@pytest.fixture(scope="module")
def profile() -> SimProfile:
    return SimProfile.load("h100-8b")


def test_same_input_gives_identical_figures(profile: SimProfile) -> None:
    a = make_plan(Workload.from_description(SMALL, 150, seed=3), profile, ClusterShape(bridges=2),
                  group_size=4, in_flight=[4, 16], rollouts=150, seed=3)
    b = make_plan(Workload.from_description(SMALL, 150, seed=3), profile, ClusterShape(bridges=2),
                  group_size=4, in_flight=[16, 4], rollouts=150, seed=3)
    assert a.to_dict() == b.to_dict()
    assert [p.in_flight for p in a.sweep] == [4, 16]
    assert all(p.rollouts_per_s > 0 and 0 < p.gpu_busy_share <= 1 for p in a.sweep)
    # Another seed draws other rollouts, so other figures.
    c = make_plan(Workload.from_description(SMALL, 150, seed=4), profile, ClusterShape(bridges=2),
                  group_size=4, in_flight=[4, 16], rollouts=150, seed=4)
    assert c.sweep[0].rollouts_per_s != a.sweep[0].rollouts_per_s


def _closed_form_s(p: dict[str, Any], calls: list[tuple[int, int]], gaps: list[float]) -> float:
    """One rollout alone on an idle engine, step by step from the profile's numbers (the engine's model)."""
    total = sum(gaps)
    held = 0  # tokens of this rollout's context in the prefix cache (full blocks)
    for prompt, output in calls:
        cached = min(min(held, prompt // p["block_tokens"] * p["block_tokens"]), prompt - 1)
        uncached = prompt - cached
        while uncached > 0:  # chunked prefill: no decoder yet, max_batched_tokens per step
            chunk = min(uncached, p["max_batched_tokens"])
            total += p["step_base_s"] + p["prefill_s_per_token"] * chunk
            uncached -= chunk
        # The last prefill step gave the first token; each later one is a decode step of one sequence.
        for generated in range(1, output):
            total += p["step_base_s"] + p["decode_s_per_seq"] + p["kv_read_s_per_token"] * (prompt + generated)
        held = (prompt + output) // p["block_tokens"] * p["block_tokens"]
    return total


def test_single_rollout_on_an_idle_engine_takes_the_closed_form_time(profile: SimProfile) -> None:
    calls = [(10000, 120), (10500, 40), (11300, 1)]  # 10,000 tokens: two prefill chunks of at most 8,192
    gaps = [1.5, 2.25]
    shape = RolloutShape(tuple(Call(p, o) for p, o in calls), tuple(gaps))
    raw = yaml.safe_load((PROFILES_DIR / "h100-8b.yaml").read_text())
    expected = _closed_form_s(raw, calls, gaps)
    # One rollout in flight on one backend: each runs alone (and finds none of the others' context cached).
    r = simulate(Workload("one", [shape]), profile, ClusterShape(bridges=1), in_flight=1, rollouts=5)
    assert r.mean_rollout_s == pytest.approx(expected, rel=1e-12)
    assert r.rollouts_per_s == pytest.approx(1 / expected, rel=1e-12)
    # Busy all the time except the tool waits.
    assert r.gpu_busy_share == pytest.approx((expected - sum(gaps)) / expected, rel=1e-9)


def test_engine_and_planner_share_one_step_model(profile: SimProfile) -> None:
    engine = SimEngine(profile)
    assert engine._step_s(300, 7, 21000) == profile.step_s(300, 7, 21000)
    looped = sum(profile.step_s(0, 5, 4000 + 5 * i) for i in range(37))
    assert profile.decode_steps_s(5, 4000, 37) == pytest.approx(looped, rel=1e-12)
    slower = SimProfile.load("h100-8b", step_base_s=0.016)
    assert slower.step_s(0, 1, 0) > profile.step_s(0, 1, 0)


def test_throughput_does_not_fall_with_more_slots_or_bridges(profile: SimProfile) -> None:
    work = Workload.from_description(SMALL, 200, seed=1)
    by_slots = [simulate(work, profile, ClusterShape(bridges=2, nodes=1, slots=s), 32, 200).rollouts_per_s
                for s in (2, 4, 8, 32)]
    assert by_slots == sorted(by_slots)
    assert by_slots[-1] > by_slots[0] * 2  # slot-bound at 2: more slots must help a lot
    by_bridges = [simulate(work, profile, ClusterShape(bridges=b), 64, 200).rollouts_per_s for b in (1, 2, 4)]
    assert by_bridges == sorted(by_bridges)
    assert by_bridges[-1] > by_bridges[0]


def test_recommendation_rule() -> None:
    def pred(n: int, groups: float) -> Prediction:
        return Prediction(n, groups / 10, groups, 0.5, 10.0, 0.9, 100, 100.0)

    # 32 is within 5% of the best (64): fewer in flight wins; 16 is not.
    assert recommend([pred(16, 90.0), pred(32, 96.0), pred(64, 100.0), pred(128, 99.0)]).in_flight == 32
    assert recommend([pred(8, 10.0)]).in_flight == 8


def test_a_workload_with_no_informative_group_says_so_and_recommends_by_rollouts(profile: SimProfile) -> None:
    """A first run where every reward is 0 (a weak model): no DAPO step would ever end; the plan says so and
    applies its rule to rollouts/s, not to groups it cannot have."""
    work = Workload.from_description({**SMALL, "p_solve": 0.0}, 120, seed=2)
    plan = make_plan(work, profile, ClusterShape(bridges=2), group_size=4, in_flight=[4, 8, 16, 32], rollouts=120)
    assert plan.p_informative == 0.0
    assert plan.rule == RULE_NO_SIGNAL and "no group of this workload is informative" in plan.rule
    best = max(p.rollouts_per_s for p in plan.sweep)
    within = [p.in_flight for p in plan.sweep if p.rollouts_per_s >= best * 0.95]
    assert plan.recommended.in_flight == min(within)
    informative = make_plan(Workload.from_description(SMALL, 120, seed=2), profile, ClusterShape(bridges=2),
                            group_size=4, in_flight=[4, 8], rollouts=120)
    assert informative.rule == RULE


def _result_line(job_id: str, group: str, reward: float, state: str = "done",
                 calls: tuple[tuple[float, float, int, int], ...] = ()) -> str:
    """One line exactly as `prorl results --out` writes it (JobResult.to_wire), with a node-recorded timeline."""
    events: list[list[Any]] = [["submitted", 0.0, 0.0], ["queued", 0.001, 0.0], ["assigned", 0.002, 0.0],
                               ["received", 0.004, 0.0], ["wait", 0.004, 0.001, {"stage": "init"}],
                               ["stage", 0.005, 0.5, {"stage": "init"}]]
    run_start = 0.505
    end = run_start
    for t, dur, prompt, output in calls:
        events.append(["generate", t, dur, {"backend": "sim-0", "prompt": prompt, "output": output}])
        end = t + dur
    events.append(["stage", run_start, end - run_start + 0.01, {"stage": "run"}])
    events.append(["stage", end + 0.01, 0.2, {"stage": "eval"}])
    events.append(["finished", end + 0.21, 0.0, {"state": state}])
    result = JobResult(job_id=job_id, task="sim_agent", state=state, node_id="node-0", reward=reward,
                       stage_s={"run": 1.0}, active_s=1.0, output={"turns": len(calls)}, group_id=group,
                       events=events)
    return json.dumps(result.to_wire())


def test_workload_from_a_results_file(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    first = ((0.6, 2.0, 2000, 150), (3.1, 1.0, 2700, 80))  # gap 3.1 - 2.6 = 0.5 s
    lines = [
        _result_line("run-0-0", "run-0", 1.0, calls=first),
        _result_line("run-0-1", "run-0", 0.0, calls=((0.7, 1.0, 2000, 10),)),
        "",  # blank lines are skipped
        _result_line("run-1-0", "run-1", 1.0, calls=((0.6, 1.0, 500, 20), (2.0, 1.0, 900, 30), (5.5, 0.5, 1500, 5))),
        _result_line("run-1-1", "run-1", 1.0, calls=((0.6, 1.0, 500, 20),)),
        _result_line("run-2-0", "run-2", 0.0, state="cancelled", calls=((0.6, 1.0, 500, 20),)),
        *(_result_line(f"run-3-{k}", "run-3", reward, calls=((0.6, 1.0, 700, 9),)) for k, reward in enumerate([1, 0, 1])),
    ]
    # A failed call (no output) is not a call the GPU served.
    failed = json.loads(lines[1])
    failed["events"].insert(6, ["generate", 0.55, 0.01, {"prompt": 2000, "ok": False, "error": "BackendFailed"}])
    lines[1] = json.dumps(failed)
    path.write_text("\n".join(lines) + "\n")

    w = Workload.from_results(path)
    assert w.skipped == 1  # the cancelled job
    assert [[(c.prompt_tokens, c.output_tokens) for c in s.calls] for s in w.shapes] == [
        [(2000, 150), (2700, 80)], [(2000, 10)], [(500, 20), (900, 30), (1500, 5)], [(500, 20)], *[[(700, 9)]] * 3]
    assert w.shapes[0].gaps_s == pytest.approx((0.5,))
    assert w.shapes[2].gaps_s == pytest.approx((0.4, 2.5))
    assert w.shapes[0].lead_s == pytest.approx(0.6 - 0.005)  # from the first stage to the first call
    assert w.shapes[0].tail_s == pytest.approx(0.01 + 0.2)  # last call's end to the eval stage's end
    assert [s.reward for s in w.shapes] == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    # Groups of 2 as measured: run-0 informative, run-1 not (run-3, of another size, aside).
    assert w.p_informative(2) == 0.5
    assert w.p_informative(3) == 1.0  # run-3 alone
    # No group of 4: each group's success rate in 1 - p^n - (1-p)^n, averaged (p: 1/2, 1, 2/3).
    assert w.p_informative(4) == pytest.approx((1 - 2 * 0.5 ** 4 + 0.0 + 1 - (2 / 3) ** 4 - (1 / 3) ** 4) / 3)
    # A replay that ran 20 times faster than its workload: its gaps are 20 times longer in GPU time.
    assert Workload.from_results(path, time_scale=20).shapes[0].gaps_s == pytest.approx((10.0,))


def test_workload_from_parquet_results_is_the_one_from_their_jsonl(tmp_path: Path) -> None:
    # What `prorl submit/results --out X.parquet` writes for the same jobs (each with a trajectory, which is
    # what such a file holds): the planner reads the same calls, gaps, lead/tail times, rewards and groups.
    pytest.importorskip("pyarrow.parquet", reason="the parquet extra (pyarrow) is not installed")
    from prorl_cli.agent.trajectory import write_parquet
    from prorl_cli.cli.jobs.collect import parquet_rows

    traj = {"sequence_ids": [1, 2, 3], "loss_mask": [0, 0, 1], "logprobs": [0.0, 0.0, -0.5], "stop_reason": "stop"}
    lines = [
        _result_line("run-0-0", "run-0", 1.0, calls=((0.6, 2.0, 2000, 150), (3.1, 1.0, 2700, 80))),
        _result_line("run-0-1", "run-0", 0.0, calls=((0.7, 1.0, 2000, 10),)),
        _result_line("run-1-0", "run-1", 1.0, calls=((0.6, 1.0, 500, 20), (2.0, 1.0, 900, 30), (5.5, 0.5, 1500, 5))),
        _result_line("run-2-0", "run-2", 0.0, state="cancelled", calls=((0.6, 1.0, 500, 20),)),
    ]
    jsonl = tmp_path / "results.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    results = []
    for line in lines:
        result = JobResult.from_wire(json.loads(line))
        result.output = {"trajectory": traj}
        results.append(result)
    parquet = tmp_path / "results.parquet"
    write_parquet(parquet, parquet_rows(results))

    want, got = Workload.from_results(jsonl, time_scale=2), Workload.from_results(parquet, time_scale=2)
    assert got.shapes == want.shapes and got.skipped == want.skipped == 1
    assert got.p_informative(2) == want.p_informative(2)


def test_workload_description_draws_like_sim_agent() -> None:
    w = Workload.from_description({**SMALL, "turns": 4, "seed": 9, "time_scale": 20}, 30, seed=0)
    for s in w.shapes:
        assert len(s.calls) == 4 and len(s.gaps_s) == 3
        assert s.calls[0].prompt_tokens == 1000
        for a, b in zip(s.calls, s.calls[1:], strict=False):
            assert b.prompt_tokens > a.prompt_tokens + a.output_tokens  # the context grows by output and observation
        assert all(1 <= c.output_tokens <= 400 for c in s.calls)
    p = [0.0, 0.3, 0.5, 1.0]
    assert w.p_informative(4) == pytest.approx(sum(1 - q ** 4 - (1 - q) ** 4 for q in p) / 4)


@pytest.mark.parametrize(("desc", "fragment"), [
    ({"output_tokens": {"median": -5}}, "output_tokens.median must be a number > 0, got -5"),
    ({"turns": [5, 2]}, "turns must be"),
    ({"p_solve": 1.5}, "p_solve must be a probability"),
    ({"tool_s": {"mean": 1}}, "tool_s: unknown key(s) ['mean']"),
    ({"turnz": 3}, "unknown field(s) ['turnz']"),
    ([1, 2], "a workload description is a map"),
])
def test_bad_descriptions_name_the_field(desc: Any, fragment: str) -> None:
    with pytest.raises(PlanError) as e:
        Workload.from_description(desc, 10, where="w.yaml")
    assert str(e.value).startswith("w.yaml: ") and fragment in str(e.value)


def test_bad_results_files_name_the_file_and_line(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="nope.jsonl: no such results file"):
        Workload.from_results(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_result_line("a", "g", 1.0, calls=((0.6, 1.0, 10, 2),)) + "\n{not json\n")
    with pytest.raises(PlanError, match=r"bad.jsonl:2: not valid JSON"):
        Workload.from_results(bad)
    row = json.loads(_result_line("a", "g", 1.0, calls=((0.6, 1.0, 10, 2),)))
    del row["events"][6][3]["output"]
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(PlanError, match=r"bad.jsonl:1: events\[6\] \(generate\) needs a token count attrs.output"):
        Workload.from_results(bad)
    bad.write_text(_result_line("a", "g", 1.0, state="failed", calls=((0.6, 1.0, 10, 2),)) + "\n")
    with pytest.raises(PlanError, match="no finished rollout"):
        Workload.from_results(bad)
    # A collector killed mid-write: whole lines, then half of one.
    whole = _result_line("a", "g", 1.0, calls=((0.6, 1.0, 10, 2),)) + "\n"
    bad.write_text(whole + whole[:40])
    with pytest.raises(PlanError, match=r"bad.jsonl:2: the last line is cut off .*the 1 line\(s\) before it are whole"):
        Workload.from_results(bad)


def test_bad_cluster_shapes(profile: SimProfile) -> None:
    work = Workload.from_description(SMALL, 10)
    with pytest.raises(PlanError, match="bridges must be at least 1, got 0"):
        simulate(work, profile, ClusterShape(bridges=0), 4, 10)
    with pytest.raises(PlanError, match="in_flight must be at least 1"):
        simulate(work, profile, ClusterShape(bridges=1), 0, 10)
    with pytest.raises(PlanError, match="group size must be at least 2"):
        make_plan(work, profile, ClusterShape(bridges=1), group_size=1, in_flight=[4], rollouts=10)


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, ["plan", *args])


def test_cli_plan(tmp_path: Path, profile: SimProfile) -> None:
    wfile = tmp_path / "w.yaml"
    wfile.write_text(yaml.safe_dump(SMALL))
    res = _invoke("--workload", str(wfile), "--bridges", "2", "--group-size", "4", "--in-flight", "4,8",
                  "--rollouts", "60", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [p["in_flight"] for p in doc["sweep"]] == [4, 8]
    assert doc["recommended"]["in_flight"] in (4, 8)
    assert doc["cluster"]["bridges"] == 2
    # The same figures as the API gives.
    direct = make_plan(Workload.from_description(SMALL, 60, seed=0, where=str(wfile)), profile, ClusterShape(bridges=2),
                       group_size=4, in_flight=[4, 8], rollouts=60)
    assert doc["sweep"] == json.loads(json.dumps(direct.to_dict()))["sweep"]
    table = _invoke("--workload", str(wfile), "--bridges", "2", "--in-flight", "4,8", "--rollouts", "60")
    assert table.exit_code == 0, table.output
    assert "recommended: --max-in-flight" in table.stdout and "informative" in table.stdout
    # A sim_agent instance copied whole: its replay-only fields are said to be unused, not silently dropped.
    wfile.write_text(yaml.safe_dump({**SMALL, "time_scale": 10, "seed": 3}))
    noted = _invoke("--workload", str(wfile), "--bridges", "2", "--in-flight", "4", "--rollouts", "60")
    assert noted.exit_code == 0, noted.output
    assert "seed, time_scale steer a live replay and are not used here" in noted.stderr, noted.stderr


@pytest.mark.parametrize(("args", "fragment"), [
    (["--results", "{tmp}/missing.jsonl", "--bridges", "1"], "missing.jsonl: no such results file"),
    (["--results", "{tmp}/bad.jsonl", "--bridges", "1"], "bad.jsonl:1: not valid JSON"),
    (["--workload", "{tmp}/neg.yaml", "--bridges", "1"], "output_tokens.median must be a number > 0, got -3"),
    # A bad option is a usage error naming the option, as click's other range checks are.
    (["--workload", "{tmp}/neg.yaml", "--bridges", "0"], "Invalid value for '--bridges': 0 is not in the range x>=1"),
    (["--bridges", "1"], "give the workload as one of --results FILE or --workload FILE.yaml"),
    (["--workload", "{tmp}/neg.yaml", "--bridges", "1", "--profile", "nosuch"], "sim profile 'nosuch'"),
])
def test_cli_bad_input(tmp_path: Path, args: list[str], fragment: str) -> None:
    (tmp_path / "bad.jsonl").write_text("not json\n")
    (tmp_path / "neg.yaml").write_text(yaml.safe_dump({"output_tokens": {"median": -3}}))
    res = _invoke(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    usage = "--bridges" in fragment
    assert res.exit_code == (2 if usage else 1)
    assert ("Error:" if usage else "error:") in res.stderr and fragment in res.stderr
    assert "Traceback" not in res.output


def test_a_candidate_with_more_in_flight_than_rollouts_is_simulated_to_a_steady_state(profile: SimProfile) -> None:
    """Asked for 40 rollouts at 1,000 in flight, the first burst's quickest rollouts made a rate hundreds of
    times what the saturated GPUs deliver at 200; each candidate now runs long enough for its slots to turn
    over (STEADY_ROLLOUTS_PER_SLOT), and an absurd one is refused."""
    from prorl_cli.planning.plan import MAX_RUNNING, STEADY_ROLLOUTS_PER_SLOT

    work = Workload.from_description(SMALL, 40, seed=5)
    plan = make_plan(work, profile, ClusterShape(bridges=1), group_size=4, in_flight=[200, 1000], rollouts=40)
    saturated, beyond = plan.sweep
    assert saturated.gpu_busy_share > 0.95, "200 in flight already keep the GPU busy"
    assert beyond.simulated_rollouts == STEADY_ROLLOUTS_PER_SLOT * 1000 and plan.rollouts == 40
    assert beyond.rollouts_per_s <= 1.5 * saturated.rollouts_per_s, (saturated, beyond)
    # Slots bound what runs at once: 1,000 in flight on 2 x 16 slots is simulated as 32 running.
    slotted = make_plan(work, profile, ClusterShape(bridges=1, nodes=2, slots=16), group_size=4, in_flight=[1000],
                        rollouts=40)
    assert slotted.sweep[0].simulated_rollouts == STEADY_ROLLOUTS_PER_SLOT * 32
    with pytest.raises(PlanError, match=f"more than {MAX_RUNNING} rollouts running at once"):
        make_plan(work, profile, ClusterShape(bridges=1), group_size=4, in_flight=[8, MAX_RUNNING + 1], rollouts=40)


def test_notes_say_what_the_figures_do_not(profile: SimProfile) -> None:
    """Candidates above the slots repeat the capped row, and a recommendation at the largest candidate may be
    short of the best: both are said, not left to be read off the table."""
    from prorl_cli.planning.plan import plan_notes

    def pred(n: int, groups: float) -> Prediction:
        return Prediction(n, groups / 10, groups, 0.5, 10.0, 0.9, 100, 100.0)

    work = Workload.from_description(SMALL, 10, seed=0)
    rising = [pred(8, 50.0), pred(16, 80.0), pred(32, 100.0)]
    edge = plan_notes(work, profile, None, rising, recommend(rising))
    assert len(edge) == 1 and "largest candidate tried (32)" in edge[0], edge
    peaked = [pred(8, 50.0), pred(16, 100.0), pred(32, 99.0)]
    assert plan_notes(work, profile, None, peaked, recommend(peaked)) == ()
    # On 2 x 8 slots, 32 in flight run 16 at once: said; and 32 is no edge to push past.
    capped = [pred(8, 50.0), pred(16, 100.0), pred(32, 100.0)]
    notes = plan_notes(work, profile, 16, capped, recommend(capped))
    assert notes == ("in flight [32] exceed the 16 rollout slots (--nodes x --slots): they run 16 at once, so they "
                     "deliver what 16 in flight would",)
    # Through make_plan and the command line.
    plan = make_plan(work, profile, ClusterShape(bridges=1, nodes=1, slots=2), group_size=4, in_flight=[2, 4],
                     rollouts=10)
    assert any("in flight [4] exceed the 2 rollout slots" in n for n in plan.notes), plan.notes
    assert json.loads(json.dumps(plan.to_dict()))["notes"] == list(plan.notes)  # --json carries them


def test_results_recorded_faster_than_the_profile_are_noted(tmp_path: Path, profile: SimProfile) -> None:
    """A sim engine at 20x records calls 20 times shorter than its GPU time, and tool gaps as short: read
    without --time-scale they plan a workload with next to no tool time. Calls faster than the profile can
    serve them even one at a time say so; calls as long as the profile's are not flagged."""
    # 300 output tokens over a 2,000-token prompt: at least 299 decode steps of 8 ms on h100-8b (about 2.4 s).
    least_s = profile.decode_steps_s(1, 2000, 299)
    fast, slow = tmp_path / "fast.jsonl", tmp_path / "slow.jsonl"
    fast.write_text(_result_line("r-0-0", "r-0", 1.0, calls=((0.6, least_s / 20, 2000, 300),)) + "\n")
    slow.write_text(_result_line("r-0-0", "r-0", 1.0, calls=((0.6, least_s * 1.5, 2000, 300),)) + "\n")

    def notes(path: Path, time_scale: float = 1.0) -> tuple[str, ...]:
        work = Workload.from_results(path, time_scale=time_scale)
        return make_plan(work, profile, ClusterShape(bridges=1), group_size=2, in_flight=[1], rollouts=8).notes

    [note] = notes(fast)
    assert note.startswith(f"{fast}: its generate calls took") and "20 times less" in note and "--time-scale" in note
    assert notes(slow) == ()
    assert notes(fast, time_scale=20) == ()  # said: the recording's clock is accounted for
    res = _invoke("--results", str(fast), "--bridges", "1", "--in-flight", "1", "--rollouts", "8")
    assert res.exit_code == 0, res.output
    assert "note: " + str(fast) + ": its generate calls took" in res.stdout


def test_results_in_the_order_they_ended_are_replayed_as_a_fair_sample(profile: SimProfile) -> None:
    """A results file lists rollouts as they ended: the quick ones first. Replayed in that order, a simulation
    shorter than the file saw only the quick ones and predicted several times the rollouts/s; the planner now
    replays a seeded shuffle, so the file's order does not change the figures much."""
    quick = RolloutShape((Call(1000, 20),), ())
    slow = RolloutShape(tuple(Call(1000 + 400 * k, 100) for k in range(12)), (2.0,) * 11)
    quick_first = Workload("ended-order.jsonl", [quick] * 400 + [slow] * 400)
    slow_first = Workload("reversed.jsonl", [slow] * 400 + [quick] * 400)

    def rate(work: Workload) -> float:
        plan = make_plan(work, profile, ClusterShape(bridges=1), group_size=2, in_flight=[4], rollouts=100)
        return plan.sweep[0].rollouts_per_s

    a, b = rate(quick_first), rate(slow_first)
    assert 0.67 < a / b < 1.5, (a, b)


def test_rewards_on_any_scale_make_informative_groups(tmp_path: Path, profile: SimProfile) -> None:
    """Rewards of -1/1 (or partial credit) in groups of another size than --group-size: the success-rate
    formula clamped the mean (0 for a -1/1 group) and said no group was ever informative; the chance now
    comes from the share of each reward value, as for 0/1 rewards."""
    path = tmp_path / "signed.jsonl"
    rewards = {"a": [-1.0, 1.0], "b": [1.0, 1.0], "c": [0.5, 0.5], "d": [0.0, 0.5]}
    path.write_text("".join(_result_line(f"{g}-{k}", g, r, calls=((0.6, 1.0, 500, 20),)) + "\n"
                            for g, rs in rewards.items() for k, r in enumerate(rs)))
    w = Workload.from_results(path)
    # a and d: two values, half each; b and c: one value.
    assert w.p_informative(4) == pytest.approx(2 * (1 - 2 * 0.5 ** 4) / 4)
    assert w.p_informative(2) == 0.5  # groups of 2 measured: a and d differ
    plan = make_plan(w, profile, ClusterShape(bridges=1), group_size=4, in_flight=[2], rollouts=8)
    assert plan.rule == RULE and plan.p_informative > 0
    # Without groups: the whole file's reward values.
    flat = Workload("flat", [RolloutShape((Call(500, 20),), (), reward=r) for r in (-1.0, 1.0, 1.0, -1.0)])
    assert flat.p_informative(8) == pytest.approx(1 - 2 * 0.5 ** 8)


def test_results_left_out_are_counted_by_reason_and_noted(tmp_path: Path, profile: SimProfile) -> None:
    """Failed, timed-out and cancelled jobs (and finished ones with no generate call) were dropped without a
    word, so a run where half the rollouts timed out planned as if they had not run; the plan now says how
    many were left out and why, and that their cost is not in the figures."""
    path = tmp_path / "mixed.jsonl"
    no_calls = json.loads(_result_line("e-0", "e", 1.0, calls=()))
    path.write_text("\n".join([
        _result_line("a-0", "a", 1.0, calls=((0.6, 1.0, 500, 20),)),
        _result_line("a-1", "a", 0.0, calls=((0.6, 1.0, 500, 20),)),
        _result_line("b-0", "b", 0.0, state="failed", calls=((0.6, 1.0, 500, 20),)),
        _result_line("b-1", "b", 0.0, state="timed_out", calls=((0.6, 1.0, 500, 20),)),
        _result_line("c-0", "c", 0.0, state="timed_out", calls=((0.6, 1.0, 500, 20),)),
        json.dumps(no_calls),
    ]) + "\n")
    w = Workload.from_results(path)
    assert w.skipped == 4 and w.skipped_by == (("failed", 1), ("timed_out", 2), ("done without generate events", 1))
    plan = make_plan(w, profile, ClusterShape(bridges=1), group_size=2, in_flight=[1], rollouts=8)
    [note] = [n for n in plan.notes if "left out" in n]
    assert note.startswith(f"{path}: 4 of 6 results left out (failed 1, timed_out 2, done without generate events 1)")
    res = _invoke("--results", str(path), "--bridges", "1", "--in-flight", "1", "--rollouts", "8")
    assert res.exit_code == 0, res.output
    assert "4 of 6 results left out" in res.stdout
    # An empty file says so, rather than "no finished rollout among 0 result(s)".
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(PlanError, match="empty.jsonl: no results in the file"):
        Workload.from_results(empty)
    only_failed = tmp_path / "failed.jsonl"
    only_failed.write_text(_result_line("b-0", "b", 0.0, state="failed", calls=((0.6, 1.0, 500, 20),)) + "\n")
    with pytest.raises(PlanError, match=r"among 1 result\(s\): failed 1"):
        Workload.from_results(only_failed)


def test_rollouts_with_overlapping_calls_are_noted(tmp_path: Path, profile: SimProfile) -> None:
    """A harness job whose sub-agents call the model at once records overlapping generate spans; the replay
    runs them one after another (slower than they ran), which the plan now says instead of leaving unsaid."""
    path = tmp_path / "subagents.jsonl"
    path.write_text("\n".join([
        # Two sub-agents' calls at once (0.6-1.6 and 0.8-1.8), then the parent's.
        _result_line("h-0", "h", 1.0, calls=((0.6, 1.0, 500, 20), (0.8, 1.0, 700, 30), (2.0, 1.0, 900, 10))),
        _result_line("h-1", "h", 0.0, calls=((0.6, 1.0, 500, 20), (2.0, 1.0, 900, 10))),
    ]) + "\n")
    w = Workload.from_results(path)
    assert [s.overlapping_calls for s in w.shapes] == [1, 0]
    plan = make_plan(w, profile, ClusterShape(bridges=1), group_size=2, in_flight=[1], rollouts=8)
    assert any(n.startswith(f"{path}: 1 of 2 rollouts made generate calls while another of theirs ran")
               for n in plan.notes), plan.notes
