"""The ProRL Agent paper's Table 3, replayed on simulated GPUs through real prorl processes.

One seeded SWE-like workload (``prorl_cli/testing/handlers/sim_agent.py``: 10-40 turns per
rollout, prompts growing by each observation to tens of thousands of tokens,
log-normal tool time) is sampled by prorl's own DAPO sampler
(:class:`prorl_cli.training.sampler.DapoSampler`): groups of ``--n`` rollouts,
``--in-flight`` jobs kept running (a new group is submitted as soon as there is
room), each step ending when ``--target`` groups are informative (rewards not
all equal). The deployment is a real broker, one node with RUN slots for twice
the in-flight jobs, and 4 bridges with the simulated H100/8B engine
(``prorl serve inference --engine sim``), all child processes on this machine.
Configurations, one fresh deployment each, the same prompts and job ids each:

* ``full``: prorl as shipped (least-loaded sticky routing, early termination
  cancels the step's unfinished groups, cancel propagation to the engines);
* ``round_robin``: ``broker.routing_policy: round_robin`` (no stickiness);
* ``ever_assigned``: ``broker.routing_policy: ever_assigned`` (the paper's server routing);
* ``no_cleanup``: no stale-job cleanup as the issue defines it: early
  termination abandons the unfinished groups without cancelling them
  (``SamplerConfig.cancel_dropped: False``) and ``broker.cancel_propagation:
  false``, so they and their model calls run on, results ignored;
* ``sync``: no stale-job cleanup as the paper ran it ("waiting for all jobs to
  finish"): ``SamplerConfig.mode: sync``, batches of ``--in-flight`` jobs, each
  waited for to the last rollout (surplus informative groups feed the next
  steps within ``max_staleness``); ``sync_s1``: the same with ``max_staleness: 1``;
* ``carry_over``: the sampler's defaults (``SamplerConfig.carry_over: True``:
  unfinished groups complete into the next step instead of being cancelled,
  at most ``carry_window_steps: 1.75`` steps' worth of groups in flight,
  ``max_staleness: 2``; not in the paper) with the broker's KV-cache
  admission filling each backend's cache (``broker.kv_admission: 1.0``);
* ``carry_over_w15``: the defaults before (``carry_window_steps: 1.5``,
  ``broker.kv_admission: 0.7``); ``carry_over_w10``: the ones before that
  (``carry_window_steps: 1.0``, ``max_staleness: 1``, ``kv_admission: 0.7``);
  ``carry_over_s1``: the default window with ``max_staleness: 1``;
  ``carry_over_w20``: a window of 2.0 steps; ``carry_over_kv70``: the default
  window with ``broker.kv_admission: 0.7``; ``sync_kv70``: ``sync`` so;
* ``carry_over_before``: carry-over as it was before the carry window and KV
  admission (``carry_window_steps: 0``, ``broker.kv_admission: 0``,
  ``max_staleness: 1``);
* ``tmux``: every tool action takes ``--tmux-delay-s`` longer (tmux-style polling).

Time, by default (``--clock simulated``), is simulated: the broker, the
node server, the 4 bridges and their engines and the sampler run as tasks
of one event loop whose clock jumps to the next timer once nothing is left
to do at the current instant (:mod:`prorl_cli.timebase`,
:class:`prorl_cli.testing.simulated.SimulatedDeployment`), the same classes
the child processes run, over ZeroMQ ``inproc`` sockets. A hop between them
takes no time, tool waits are the modelled ones, and the same seed gives
the same figures to the last digit however loaded this machine is.
``--clock wall`` runs them as child processes on real time, ``--speedup``
times faster than the simulated GPU (tool waits too); rates are then
reported in GPU time (wall rate / speedup), and the rollouts' tool waits
absorb this machine's hops (``sim_agent``'s ``absorb_hops``: the time a
call spent outside its engine, node, broker and bridge waiting for a core
comes out of the next tool wait); ``--real-hops`` turns that off (the
hops, times the speed-up, then count as tool time: the replay measures
this machine's CPU latency as well). Printed per configuration (mean and spread over ``--seeds``):
instances/s (rollouts of completed groups, informative or filtered, per
second), busy fraction and prefix-cache hit rate of the backends, and the
ratio to ``full``, beside the paper's figures; ``--plot`` saves a PNG.

The useful-work table comes from the simulated engines' own ledgers
(``inference.sim_ledger_dir``; :mod:`prorl_cli.training.gpu_ledger`): busy
GPU-seconds per outcome of the job that spent them (informative group,
filtered group, failed, cancelled at a step's end, cancelled as stale, in
flight when the replay ended), prefill tokens recomputed because a job's
earlier context was no longer cached where its next call went (evicted, or
moved to another backend), per-step GPU time, idle GPU time and jobs in
flight, the off-policy token share (output tokens of returned groups
submitted under an older policy version), and informative groups per
GPU-second: per held GPU-second (the replay's window x backends: counts
idle time, so it moves with this machine's load) and per busy GPU-second
(engine step clocks only: does not). ``--plot-breakdown`` draws it.

``--weight-sync`` makes each step boundary a trainer's: ``update_weights`` to
version k+1 (each bridge lets its calls in flight finish, the engine is held
``--reload-gpu-s`` for the load and drops its prefix cache, so a carried
rollout's next call prefills its whole context again). A rollout carried
across the sync then has calls of two versions, and the off-policy share is
also counted per token (the version that served it, the rollout's
``tokens_by_version``): a carried rollout's tail is on-policy, its head is
not. ``--plot-pareto`` draws informative groups per GPU-second against
that share, the two axes of the throughput/staleness trade-off.

    python benchmarks/table3.py [--steps 12] [--n 4] [--target 8] [--in-flight 128] [--clock wall [--speedup 20]]
        [--seeds 0,1,2] [--only full,sync,carry_over] [--plot docs/img/table3.png]
        [--plot-breakdown docs/img/table3_breakdown.png] [--weight-sync [--reload-gpu-s 2]]
        [--plot-pareto docs/img/table3_pareto.png] [--json out.json] [--from-json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prorl_cli import timebase
from prorl_cli.client import AsyncRolloutClient
from prorl_cli.embedded import LocalStack
from prorl_cli.exceptions import ConfigError
from prorl_cli.testing.simulated import SimulatedDeployment
from prorl_cli.training.gpu_ledger import OUTCOMES, breakdown, idle_gpu_s, load_ledgers
from prorl_cli.training.sampler import DapoSampler, SamplerConfig

BACKENDS = 4
#: Per configuration: prorl config overrides ("broker"), sampler settings ("sampler"), tmux-style tools ("tmux").
CONFIGS: dict[str, dict[str, Any]] = {
    "full": {},
    "round_robin": {"broker": {"routing_policy": "round_robin"}},
    "ever_assigned": {"broker": {"routing_policy": "ever_assigned"}},
    "no_cleanup": {"broker": {"cancel_propagation": False}, "sampler": {"cancel_dropped": False}},
    "sync": {"sampler": {"mode": "sync"}},
    # Wait-for-all batching that drops surplus groups one version old, as the defaults did before.
    "sync_s1": {"sampler": {"mode": "sync", "max_staleness": 1}},
    "carry_over": {"sampler": {"carry_over": True}},
    # The defaults before: a 1.5-step window, KV admission filling 70% of each cache.
    "carry_over_w15": {"sampler": {"carry_over": True, "carry_window_steps": 1.5}, "broker": {"kv_admission": 0.7}},
    # The defaults before those: a one-step window and one version of staleness.
    "carry_over_w10": {"sampler": {"carry_over": True, "carry_window_steps": 1.0, "max_staleness": 1},
                       "broker": {"kv_admission": 0.7}},
    # The default window with the staleness limit of before: the window's tail is cancelled as stale.
    "carry_over_s1": {"sampler": {"carry_over": True, "max_staleness": 1}},
    # A wider window: the lag's tail runs into the staleness limit.
    "carry_over_w20": {"sampler": {"carry_over": True, "carry_window_steps": 2.0}},
    # The default window with the KV admission of before: jobs queue at the broker instead of running.
    "carry_over_kv70": {"sampler": {"carry_over": True}, "broker": {"kv_admission": 0.7}},
    # Wait-for-all batching with the KV admission of before (as sync ran in the earlier runs).
    "sync_kv70": {"sampler": {"mode": "sync"}, "broker": {"kv_admission": 0.7}},
    # Carry-over before the carry window and KV admission.
    "carry_over_before": {"sampler": {"carry_over": True, "carry_window_steps": 0.0, "max_staleness": 1},
                          "broker": {"kv_admission": 0.0}},
    "tmux": {"tmux": True},
    # Over a dataset walked several times (--prompts): prompts whose last group was filtered are mostly skipped.
    "carry_over_skip": {"sampler": {"carry_over": True, "skip_filtered_prompts": 0.9}},
    "carry_over_w15_skip": {"sampler": {"carry_over": True, "carry_window_steps": 1.5, "skip_filtered_prompts": 0.9}},
    "carry_over_w125_skip": {"sampler": {"carry_over": True, "carry_window_steps": 1.25, "skip_filtered_prompts": 0.9}},
    "sync_skip": {"sampler": {"mode": "sync", "skip_filtered_prompts": 0.9}},
}
DEFAULT_CONFIGS = ("full", "round_robin", "ever_assigned", "no_cleanup", "sync", "tmux")
# The paper's Table 3 (instances/s, GPU utilisation; tmux: seconds per action); configurations it did not run are absent.
PAPER: dict[str, tuple[float, float]] = {
    "full": (0.37, 0.78),
    "round_robin": (0.30, 0.65),  # the paper's "without load balancing"
    "no_cleanup": (0.25, 0.42),  # the paper's "without stale job cleanup" (it waited for all jobs: our "sync")
    "sync": (0.25, 0.42),
    "sync_s1": (0.25, 0.42),
    "sync_kv70": (0.25, 0.42),
    "tmux": (0.29, 0.68),  # the paper's "without efficient bash" (0.78 s vs 0.42 s per action)
}


def paper_ratio(name: str) -> float | None:
    """The paper's instances/s of this configuration over its full system's."""
    return PAPER[name][0] / PAPER["full"][0] if name in PAPER else None


@dataclass
class Outcome:
    config: str
    seed: int
    wall_s: float
    rollouts: int
    cancelled: int
    steps: int
    instances_per_s: float  # GPU time
    busy_fraction: float
    prefix_hit_rate: float
    aborted_calls: int
    skipped: str | None = None
    #: Informative groups the steps returned, over the GPU seconds the backends were held (window x backends).
    informative_groups: int = 0
    held_gpu_s: float = 0.0
    informative_per_gpu_s: float = 0.0
    #: Over busy GPU seconds only (the engines' own step clocks: does not move with the machine's load).
    informative_per_busy_gpu_s: float = 0.0
    #: Busy GPU seconds (engine clocks) per job outcome; they add up to ``busy_gpu_s``.
    busy_gpu_s: float = 0.0
    gpu_s: dict[str, float] = field(default_factory=dict)
    jobs: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    recomputed_tokens: dict[str, int] = field(default_factory=dict)
    moved_calls: int = 0
    #: Per step: GPU-time duration (wall x speedup), jobs in flight (mean of samples), engines' idle GPU seconds.
    step_gpu_s: list[float] = field(default_factory=list)
    step_in_flight: list[float] = field(default_factory=list)
    step_idle_gpu_s: list[float] = field(default_factory=list)
    #: Output tokens of returned groups submitted under an older policy version, over all returned tokens.
    off_policy_token_fraction: float = 0.0
    #: Output tokens of returned groups served by an older policy version than the step's, over all returned
    #: tokens (per token: a rollout carried across a weight sync counts only its calls before it). Equal to the
    #: group-level share above without ``--weight-sync`` would be wrong: the engines then never change version,
    #: so it is 0 there.
    stale_token_fraction: float = 0.0
    #: Mean versions behind per returned output token (per token, as above).
    token_lag_versions: float = 0.0
    #: GPU seconds the weight syncs between steps took (wall x speedup: drains and loads), and the loads alone.
    weight_sync_gpu_s: float = 0.0
    reload_gpu_s: float = 0.0
    #: Mean GPU-time gap between a job's call ending at its engine and its next call arriving there: the
    #: modelled tool time plus this machine's hops (node, broker, bridge) scaled by ``speedup``. Far above
    #: the modelled tool time, the replay measures this machine's CPU latency, not the configurations.
    call_gap_gpu_s: float = 0.0
    tool_mean_gpu_s: float = 0.0
    #: How far the engines ran behind their virtual timelines at their steps' ends, mean (GPU-s): CPU they lacked.
    engine_lag_gpu_s: float = 0.0
    #: Returned rollouts' hops (time outside the engine) per call in GPU-s, and the share of it the tool
    #: waits could not absorb (hops longer than the tool wait): with ``absorb_hops``.
    hop_gpu_s: float = 0.0
    overrun_fraction: float = 0.0


def prompts(
    seed: int, count: int, tool_median_s: float, speedup: float, action_delay_s: float, absorb_hops: bool = True,
) -> list[dict[str, Any]]:
    """The task instances, one per group; each rollout's draws come from the seed, its prompt and its index in the
    group (not the step that submitted it), so every configuration runs the same rollouts of the prompts it uses."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        # Task difficulty: some always solved, some never (uninformative), most in between.
        p_solve = rng.choice([0.0, 0.0, 1.0, 0.2, 0.4, 0.5, 0.6, 0.8])
        out.append({
            "seed": seed, "turns": [10, 40], "prompt_tokens": 2000,
            "output_tokens": {"median": 150, "sigma": 0.6, "max": 1024},
            "observation_tokens": {"median": 500, "sigma": 1.0, "max": 6000},
            "tool_s": {"median": tool_median_s, "sigma": 1.0, "max": 60.0},
            "action_delay_s": action_delay_s, "time_scale": speedup, "p_solve": p_solve, "absorb_hops": absorb_hops,
            "draws_by_prompt": True,
        })
    return out


def config_supported(extra: dict[str, Any]) -> str | None:
    """None when this prorl accepts the configuration's keys, else why not."""
    from prorl_cli.config import load_config

    path = Path(tempfile.mkstemp(suffix=".yaml")[1])
    try:
        import yaml

        path.write_text(yaml.safe_dump(extra))
        load_config(path)
    except ConfigError as e:
        return str(e)
    finally:
        path.unlink()
    return None


async def backend_totals(client: AsyncRolloutClient) -> dict[str, float]:
    totals: dict[str, float] = {}
    for b in (await client.status()).backends:
        for k, v in b.stats.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    return totals


@dataclass
class Drive:
    """What one configuration's steps measured, before the ledgers are read."""

    sampler: DapoSampler
    wall_s: float  # seconds on the replay's clock (simulated: GPU seconds)
    before: dict[str, float]
    after: dict[str, float]
    rollouts: int = 0
    cancelled: int = 0
    bounds: list[float] = field(default_factory=list)
    in_flight_means: list[float] = field(default_factory=list)
    returned: list[tuple[list[str], bool]] = field(default_factory=list)  # job ids per returned group, a version late
    stale_tokens: int = 0
    returned_tokens: int = 0
    lag_tokens: int = 0
    sync_s: float = 0.0
    hop_s: float = 0.0  # returned rollouts' hops, and the part their tool waits could not take
    unabsorbed_s: float = 0.0
    hop_calls: int = 0


async def drive(client: AsyncRolloutClient, name: str, seed: int, args: argparse.Namespace,
                tasks: list[dict[str, Any]], sampler_cfg: SamplerConfig, checkpoint: Path) -> Drive:
    """Run ``args.steps`` DAPO steps of one configuration against a deployment that is up; times on timebase.now()."""
    await asyncio.sleep(0.6)  # a first heartbeat with stats from every bridge
    before = await backend_totals(client)
    sampler = DapoSampler(client, "sim_agent", tasks, sampler_cfg)
    sampler.job_outcomes = {}
    in_flight: list[int] = []
    sampler.on_progress = lambda st: in_flight.append(st.in_flight)
    started = timebase.now()
    d = Drive(sampler, 0.0, before, {}, bounds=[started])
    try:
        for k in range(args.steps):
            in_flight.clear()
            batch = await sampler.step(policy_version=k)
            d.bounds.append(timebase.now())
            d.in_flight_means.append(round(statistics.fmean(in_flight), 1) if in_flight else 0.0)
            st = batch.stats
            d.rollouts += (len(batch.groups) + st.filtered) * args.n
            d.cancelled += st.cancelled_jobs
            d.returned += [([r.job_id for r in g.results], g.policy_version < k) for g in batch.groups]
            outputs = [r.output for g in batch.groups for r in g.results if isinstance(r.output, dict)]
            for out in outputs:
                for version, n in (out.get("tokens_by_version") or {}).items():
                    behind = k - int(version) if version.isdigit() else 0
                    d.returned_tokens += n
                    d.stale_tokens += n if behind > 0 else 0
                    d.lag_tokens += n * max(0, behind)
                d.hop_s += float(out.get("hops_s", 0.0))
                d.unabsorbed_s += float(out.get("overrun_s", 0.0))
                d.hop_calls += max(0, int(out.get("turns", 1)) - 2)  # the calls whose hops were absorbed
            if args.weight_sync and k + 1 < args.steps:
                # The trainer's step boundary: every bridge lets its calls in flight finish on the old
                # weights, loads the new ones (the cache goes with them) and serves them as version k + 1.
                t0 = timebase.now()
                await client.update_weights(checkpoint, policy_version=k + 1)
                d.sync_s += timebase.now() - t0
            if args.verbose:
                print(f"  {name} seed {seed} step {k}: {st.wall_s:.1f} s, {st.submitted_groups} groups submitted, "
                      f"{st.filtered} filtered, {st.failed_groups} failed, {st.cancelled_jobs} jobs cancelled",
                      flush=True)
        d.wall_s = timebase.now() - started
        await asyncio.sleep(0.6)  # the bridges' next heartbeat covers the end of the run
        d.after = await backend_totals(client)
    finally:
        await sampler.close(cancel_in_flight=True)
    return d


def run_config(name: str, seed: int, args: argparse.Namespace, home: Path) -> Outcome:
    spec = CONFIGS[name]
    why = config_supported({"broker": spec.get("broker", {})})
    if why:
        return Outcome(name, seed, 0, 0, 0, 0, 0, 0, 0, 0, skipped=why)
    simulated = args.clock == "simulated"
    speedup = 1.0 if simulated else args.speedup  # simulated time is GPU time
    delay = args.tmux_delay_s if spec.get("tmux") else 0.0
    sampler_cfg = SamplerConfig(**{
        "group_size": args.n, "target_groups": args.target, "max_in_flight": args.in_flight, "carry_over": False,
        "run_id": f"t3s{seed}", "timeout_s": 3600.0, "sync_batch_groups": args.in_flight // args.n,
        **spec.get("sampler", {}),
    })
    config = {
        # Fresh stats every 0.25 s, but a peer is declared dead only after 10 s: a loaded 2-core machine stalls processes.
        "broker": {"heartbeat_interval_s": 0.25, "heartbeat_liveness": 40, "journal": False, **spec.get("broker", {})},
        # Room for the sampler's jobs and the abandoned ones still running (no_cleanup); more wait in the broker's queue.
        "node": {"n_init": 32, "n_run": args.in_flight * 2, "n_eval": 32, "stop_grace_s": 3.0, "handler_paths": ["prorl_cli.testing.handlers"]},
        "jobs": {"timeout_s": 3600.0},
        "inference": {"generate_timeout_s": 3600.0, "sim_speedup": speedup, "capacity": 256,
                      "sim_ledger_dir": str(home / f"ledgers-{name}-{seed}")},
        "log_level": "WARNING",
    }
    # On simulated time a call's hops take no time: nothing to absorb.
    tasks = prompts(seed, args.prompts, args.tool_median_s, speedup, delay, absorb_hops=not (args.real_hops or simulated))
    if args.weight_sync:
        # The default profile, with a weight load that holds each engine for --reload-gpu-s.
        import yaml

        from prorl_cli.inference.sim_engine import PROFILES_DIR

        profile = yaml.safe_load((PROFILES_DIR / "h100-8b.yaml").read_text())
        profile["reload_s"] = args.reload_gpu_s
        path = home / f"profile-{name}-{seed}.yaml"
        path.write_text(yaml.safe_dump(profile))
        config["inference"]["sim_profile"] = str(path)
    checkpoint = home / "checkpoint"  # the weight syncs name it (a sim engine loads nothing from it)
    checkpoint.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if simulated:
        async def on_simulated_time() -> Drive:
            async with SimulatedDeployment(home / f"{name}-{seed}", "t3", config, bridges=BACKENDS) as dep:
                return await drive(dep.client, name, seed, args, tasks, sampler_cfg, checkpoint)

        d = timebase.run_simulated(on_simulated_time())
    else:
        with LocalStack(home / f"{name}-{seed}", "t3", config) as stack:
            stack.start_broker()
            stack.start_node("node-0")
            for i in range(BACKENDS):
                bid = f"sim-{i}"
                stack.spawn(bid, "serve", "inference", "--engine", "sim", "--backend-id", bid)
            stack.wait_for(lambda st: sum(b.alive for b in st.backends) == BACKENDS, 60.0,
                           "the sim bridges to register", "sim-0")

            async def on_wall_time() -> Drive:
                client = AsyncRolloutClient(address=stack.address(), config=stack.load_config())
                try:
                    return await drive(client, name, seed, args, tasks, sampler_cfg, checkpoint)
                finally:
                    await client.close()

            d = asyncio.run(on_wall_time())
            stack.stop()
    run_s = time.monotonic() - started
    if args.verbose:
        print(f"  {name} seed {seed}: {run_s:.0f} s on this machine", flush=True)
    sampler, wall_s, before, after, returned = d.sampler, d.wall_s, d.before, d.after, d.returned
    diff = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    ledgers = load_ledgers(home / f"ledgers-{name}-{seed}")
    bd = breakdown(ledgers, sampler.job_outcomes or {})
    tokens: dict[str, int] = {}
    for led in ledgers:
        for c in led["calls"]:
            tokens[c["job_id"]] = tokens.get(c["job_id"], 0) + int(c["output_tokens"])
    gaps = call_gaps_s(ledgers)
    late = sum(tokens.get(j, 0) for ids, stale in returned if stale for j in ids)
    all_returned = sum(tokens.get(j, 0) for ids, _ in returned for j in ids)
    held_gpu_s = wall_s * speedup * BACKENDS
    busy_in_window = bd.busy_s  # cancelled work after the last step is tiny next to the run (the cancel is at once)
    informative = len(returned)
    return Outcome(
        config=name, seed=seed, wall_s=round(wall_s, 1), rollouts=d.rollouts, cancelled=d.cancelled, steps=args.steps,
        instances_per_s=round(d.rollouts / wall_s / speedup, 4),
        busy_fraction=round(diff.get("busy_s", 0) / diff["elapsed_s"], 3) if diff.get("elapsed_s") else 0.0,
        prefix_hit_rate=round(diff.get("cached_tokens", 0) / diff["prompt_tokens"], 3) if diff.get("prompt_tokens") else 0.0,
        aborted_calls=int(diff.get("aborted", 0)),
        informative_groups=informative, held_gpu_s=round(held_gpu_s, 1),
        informative_per_gpu_s=round(informative / held_gpu_s, 5),
        informative_per_busy_gpu_s=round(informative / busy_in_window, 5) if busy_in_window else 0.0,
        busy_gpu_s=round(bd.busy_s, 2), gpu_s={k: round(v, 2) for k, v in bd.gpu_s.items()},
        jobs=bd.jobs, calls=bd.calls, recomputed_tokens=bd.recomputed_tokens, moved_calls=bd.moved_calls,
        step_gpu_s=[round((b - a) * speedup, 1) for a, b in zip(d.bounds, d.bounds[1:], strict=False)],
        step_in_flight=d.in_flight_means,
        step_idle_gpu_s=[round(idle_gpu_s(ledgers, a, b), 1) for a, b in zip(d.bounds, d.bounds[1:], strict=False)],
        off_policy_token_fraction=round(late / all_returned, 3) if all_returned else 0.0,
        stale_token_fraction=round(d.stale_tokens / d.returned_tokens, 3) if d.returned_tokens else 0.0,
        token_lag_versions=round(d.lag_tokens / d.returned_tokens, 3) if d.returned_tokens else 0.0,
        weight_sync_gpu_s=round(d.sync_s * speedup, 1), reload_gpu_s=round(diff.get("reload_s", 0.0), 1),
        call_gap_gpu_s=round(statistics.fmean(gaps) * speedup, 2) if gaps else 0.0,
        # The sim_agent's tool time is log-normal: mean = median * exp(sigma^2 / 2), sigma 1.
        tool_mean_gpu_s=round(args.tool_median_s * math.exp(0.5) + delay, 2),
        engine_lag_gpu_s=round(statistics.fmean(float(led.get("lag_mean_s", 0.0)) for led in ledgers) * speedup, 2)
        if ledgers else 0.0,
        hop_gpu_s=round(d.hop_s / d.hop_calls * speedup, 3) if d.hop_calls else 0.0,
        overrun_fraction=round(d.unabsorbed_s / d.hop_s, 4) if d.hop_s else 0.0,
    )


def call_gaps_s(ledgers: list[dict[str, Any]]) -> list[float]:
    """Wall seconds between each call of a job ending at its engine and the job's next call arriving there."""
    by_job: dict[str, list[dict[str, Any]]] = {}
    for led in ledgers:
        for c in led["calls"]:
            if c["job_id"] is not None:
                by_job.setdefault(c["job_id"], []).append(c)
    gaps = []
    for calls in by_job.values():
        calls.sort(key=lambda c: c["submitted_at"])
        gaps += [b["submitted_at"] - a["ended_at"] for a, b in zip(calls, calls[1:], strict=False)
                 if a["ended_at"] is not None and a["outcome"] == "done"]
    return gaps


@dataclass
class Summary:
    """One configuration over its seeds: means and (min, max)."""

    config: str
    runs: int
    instances_per_s: float
    instances_range: tuple[float, float]
    busy_fraction: float
    busy_range: tuple[float, float]
    prefix_hit_rate: float
    ratio: float | None = None
    ratio_range: tuple[float, float] | None = None


def summarise(outcomes: list[Outcome]) -> list[Summary]:
    """Mean and spread per configuration; ratios to ``full`` per seed (same prompts), then averaged."""
    full = {o.seed: o.instances_per_s for o in outcomes if o.config == "full" and not o.skipped}
    out = []
    for name in dict.fromkeys(o.config for o in outcomes):
        runs = [o for o in outcomes if o.config == name and not o.skipped]
        if not runs:
            continue
        inst = [o.instances_per_s for o in runs]
        busy = [o.busy_fraction for o in runs]
        ratios = [o.instances_per_s / full[o.seed] for o in runs if full.get(o.seed)]
        out.append(Summary(
            name, len(runs), statistics.fmean(inst), (min(inst), max(inst)), statistics.fmean(busy),
            (min(busy), max(busy)), statistics.fmean(o.prefix_hit_rate for o in runs),
            statistics.fmean(ratios) if ratios else None, (min(ratios), max(ratios)) if ratios else None,
        ))
    return out


@dataclass
class Useful:
    """One configuration over its seeds, on the useful-work metric (informative groups per GPU-second)."""

    config: str
    per_kgpu_s: float  # informative groups per 1,000 held GPU-seconds (mean over seeds)
    per_kgpu_s_range: tuple[float, float]
    per_kbusy_s: float  # per 1,000 busy GPU-seconds (engine clocks only)
    #: Per 1,000 held GPU-seconds less the busy ones of work still in flight at the end (carried into a next
    #: step that the replay does not run; in steady state a step inherits as much as it leaves).
    per_kgpu_s_carried: float
    vs_sync_carried: float | None
    vs_sync: float | None
    vs_sync_range: tuple[float, float] | None
    vs_full: float | None
    off_policy: float
    #: Per-token off-policy share (by the version that served each token; see Outcome.stale_token_fraction).
    stale_tokens: float
    #: Mean share of held GPU-seconds per outcome, and "idle".
    shares: dict[str, float]
    recomputed_per_call: float


def useful_work(outcomes: list[Outcome]) -> list[Useful]:
    """Informative groups per GPU-second per configuration; ratios to ``sync`` and ``full`` per seed, then averaged."""
    base = {c: {o.seed: o.informative_per_gpu_s for o in outcomes if o.config == c and not o.skipped}
            for c in ("sync", "full")}
    out = []
    for name in dict.fromkeys(o.config for o in outcomes):
        runs = [o for o in outcomes if o.config == name and not o.skipped]
        if not runs:
            continue
        vals = [o.informative_per_gpu_s * 1000 for o in runs]
        carried = {o.seed: 1000 * o.informative_groups / (o.held_gpu_s - o.gpu_s.get("in_flight", 0.0)) for o in runs}
        sync_carried = {o.seed: 1000 * o.informative_groups / o.held_gpu_s
                        for o in outcomes if o.config == "sync" and not o.skipped and o.held_gpu_s}
        vs_carried = [carried[sd] / sync_carried[sd] for sd in carried if sync_carried.get(sd)]
        ratios = {c: [o.informative_per_gpu_s / base[c][o.seed] for o in runs if base[c].get(o.seed)] for c in base}
        shares: dict[str, float] = {}
        for o in runs:
            for k, v in [*o.gpu_s.items(), ("idle", max(0.0, o.held_gpu_s - o.busy_gpu_s))]:
                shares[k] = shares.get(k, 0.0) + v / o.held_gpu_s / len(runs)
        calls = sum(sum(o.calls.values()) for o in runs)
        out.append(Useful(
            name, statistics.fmean(vals), (min(vals), max(vals)),
            statistics.fmean(o.informative_per_busy_gpu_s * 1000 for o in runs),
            statistics.fmean(carried.values()), statistics.fmean(vs_carried) if vs_carried else None,
            statistics.fmean(ratios["sync"]) if ratios["sync"] else None,
            (min(ratios["sync"]), max(ratios["sync"])) if ratios["sync"] else None,
            statistics.fmean(ratios["full"]) if ratios["full"] else None,
            statistics.fmean(o.off_policy_token_fraction for o in runs),
            statistics.fmean(o.stale_token_fraction for o in runs), shares,
            sum(sum(o.recomputed_tokens.values()) for o in runs) / calls if calls else 0.0,
        ))
    return out


def plot_breakdown(useful: list[Useful], path: Path, title: str) -> None:
    """Stacked bars: where each configuration's held GPU-seconds went, and its informative groups per GPU-second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [u.config for u in useful]
    x = list(range(len(names)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
    bottom = [0.0] * len(names)
    colors = {"informative": "tab:green", "filtered": "tab:olive", "failed": "tab:brown", "cancelled": "tab:red",
              "stale": "tab:orange", "abandoned": "tab:pink", "in_flight": "tab:blue", "unknown": "black",
              "idle": "lightgray"}
    for key in [*OUTCOMES, "idle"]:
        vals = [u.shares.get(key, 0.0) * 100 for u in useful]
        if not any(vals):
            continue
        ax1.bar(x, vals, 0.6, bottom=bottom, label=key, color=colors.get(key))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax1.set_xticks(x, names, rotation=20)
    ax1.set_ylabel("% of held GPU-seconds (engine clocks; idle = held - busy)")
    ax1.legend(fontsize=7, loc="lower left", ncol=2)
    vals = [u.per_kgpu_s for u in useful]
    err = [[u.per_kgpu_s - u.per_kgpu_s_range[0] for u in useful], [u.per_kgpu_s_range[1] - u.per_kgpu_s for u in useful]]
    ax2.bar(x, vals, 0.6, yerr=err, capsize=3, color="tab:green")
    for i, u in enumerate(useful):
        if u.vs_sync is not None:
            ax2.annotate(f"{u.vs_sync:.2f}x sync", (i, u.per_kgpu_s_range[1]), ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(x, names, rotation=20)
    ax2.set_ylabel("informative groups per 1,000 GPU-s (min-max over seeds)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_pareto(useful: list[Useful], outcomes: list[Outcome], path: Path, title: str) -> None:
    """Informative groups per GPU-second against the off-policy token share, per configuration (seeds and mean).

    The share is per token (the version that served it) where the runs synced weights between steps, else
    per group (submitted under an older version): the two axes of the trade-off between throughput and staleness.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.8))
    for i, u in enumerate(useful):
        runs = [o for o in outcomes if o.config == u.config and not o.skipped]
        per_token = any(o.weight_sync_gpu_s for o in runs)
        xs = [100 * (o.stale_token_fraction if per_token else o.off_policy_token_fraction) for o in runs]
        ys = [1000 * o.informative_per_gpu_s for o in runs]
        color = f"C{i % 10}"
        ax.scatter(xs, ys, s=14, color=color, alpha=0.5)
        ax.scatter([statistics.fmean(xs)], [u.per_kgpu_s], s=60, color=color, edgecolor="black",
                   label=f"{u.config} ({'per token' if per_token else 'per group'})")
    ax.set_xlabel("off-policy output tokens, % of returned (lower is fresher)")
    ax.set_ylabel("informative groups per 1,000 held GPU-s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(summaries: list[Summary], path: Path, title: str) -> None:
    """Instances/s ratio to full and busy fraction per configuration, the paper's beside them (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s.config for s in summaries]
    x = list(range(len(names)))
    w = 0.38
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    ratios = [s.ratio or 0.0 for s in summaries]
    errs = [[(s.ratio or 0) - s.ratio_range[0] for s in summaries if s.ratio_range] or None,
            [s.ratio_range[1] - (s.ratio or 0) for s in summaries if s.ratio_range] or None]
    yerr = errs if errs[0] is not None and len(errs[0]) == len(names) else None
    ax1.bar([i - w / 2 for i in x], ratios, w, yerr=yerr, capsize=3, label="prorl (mean, min-max over seeds)")
    paper_r = [paper_ratio(n) or 0.0 for n in names]
    ax1.bar([i + w / 2 for i in x], paper_r, w, color="tab:gray", label="paper (ProRL Agent Table 3)")
    ax1.set_xticks(x, names, rotation=20)
    ax1.set_ylabel("instances/s, ratio to full")
    ax1.axhline(1.0, color="black", lw=0.6)
    ax1.legend(fontsize=8)
    busy = [s.busy_fraction * 100 for s in summaries]
    berr = [[s.busy_fraction * 100 - s.busy_range[0] * 100 for s in summaries],
            [s.busy_range[1] * 100 - s.busy_fraction * 100 for s in summaries]]
    ax2.bar([i - w / 2 for i in x], busy, w, yerr=berr, capsize=3, label="prorl: simulated GPU busy")
    ax2.bar([i + w / 2 for i in x], [PAPER[n][1] * 100 if n in PAPER else 0 for n in names], w, color="tab:gray",
            label="paper: GPU utilisation")
    ax2.axhline(85, color="tab:red", lw=0.8, ls="--", label="goal: 85%")
    ax2.set_xticks(x, names, rotation=20)
    ax2.set_ylabel("busy fraction, %")
    ax2.set_ylim(0, 100)
    ax2.legend(fontsize=8, loc="lower left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through LocalStack, which stops its children


def report(o: Outcome, args: argparse.Namespace) -> None:
    """With ``--verbose``: one configuration's figures as soon as it has run."""
    if not args.verbose or o.skipped:
        return
    print(f"  -> {o.instances_per_s:.3f} inst/s, {o.informative_per_gpu_s * 1000:.2f} informative "
          f"groups per 1000 GPU-s ({o.informative_per_busy_gpu_s * 1000:.2f} per 1000 busy), "
          f"busy {o.busy_fraction:.0%}, hits {o.prefix_hit_rate:.0%}, {o.wall_s} s", flush=True)
    print(f"     busy GPU-s by outcome: {o.gpu_s}; jobs {o.jobs}", flush=True)
    print(f"     recomputed prefill tokens {o.recomputed_tokens}, moved calls {o.moved_calls}; "
          f"steps GPU-s {o.step_gpu_s}, idle {o.step_idle_gpu_s}, in flight {o.step_in_flight}; "
          f"off-policy tokens {o.off_policy_token_fraction:.0%} by group, {o.stale_token_fraction:.0%} "
          f"by the version that served them ({o.token_lag_versions:.2f} versions behind per token); "
          f"weight syncs {o.weight_sync_gpu_s} GPU-s, loads {o.reload_gpu_s} GPU-s", flush=True)
    print(f"     gap between a job's calls {o.call_gap_gpu_s} GPU-s (modelled tool time "
          f"{o.tool_mean_gpu_s}; more is this machine's hops x {args.speedup:g} not absorbed); engines behind their "
          f"timelines by {o.engine_lag_gpu_s} GPU-s on average; hops {o.hop_gpu_s} GPU-s per call, "
          f"{o.overrun_fraction:.1%} of them longer than the tool wait", flush=True)


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="DAPO steps (more: less of the replay is its cold start and its end)")
    ap.add_argument("--n", type=int, default=4, help="rollouts per group")
    ap.add_argument("--prompts", type=int, default=4096,
                    help="the dataset's prompts, walked in order and again (fewer than the steps use: several epochs)")
    ap.add_argument("--target", type=int, default=8, help="informative groups that end a step")
    ap.add_argument("--in-flight", type=int, default=128, help="the sampler's max_in_flight (jobs running at once)")
    ap.add_argument("--clock", choices=("simulated", "wall"), default="simulated",
                    help="simulated: every role on one loop on a discrete-event clock, figures independent of this "
                         "machine's load (the default); wall: real processes on real time, --speedup times faster")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="with --clock simulated: replays run at once, one process each (default: one per core)")
    ap.add_argument("--speedup", type=float, default=20.0, help="with --clock wall: time runs this many times faster")
    ap.add_argument("--tool-median-s", type=float, default=1.0, help="median tool time per action (GPU time)")
    ap.add_argument("--tmux-delay-s", type=float, default=0.36,
                    help="extra per action in the tmux configuration (the paper: 0.78 s vs 0.42 s)")
    ap.add_argument("--real-hops", action="store_true",
                    help="tool waits do not absorb this machine's hops (they then count, times --speedup, as tool time)")
    ap.add_argument("--seeds", default="0", help="comma-separated workload seeds; each configuration runs once per seed")
    ap.add_argument("--only", default=",".join(DEFAULT_CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    ap.add_argument("--json", type=Path, help="also write the outcomes here")
    ap.add_argument("--plot", type=Path, help="save a PNG plot here (e.g. docs/img/table3.png)")
    ap.add_argument("--plot-breakdown", type=Path,
                    help="save the GPU-time breakdown (stacked bars) and informative groups per GPU-s here (PNG)")
    ap.add_argument("--plot-pareto", type=Path,
                    help="save informative groups per GPU-s against the off-policy token share here (PNG)")
    ap.add_argument("--from-json", type=Path, help="summarise and plot these saved outcomes instead of running")
    ap.add_argument("--verbose", action="store_true", help="print each step")
    ap.add_argument("--weight-sync", action="store_true",
                    help="a weight sync between steps (update_weights to version k+1: each bridge drains, loads, drops "
                         "its prefix cache), so a carried rollout's later calls run on the new weights; the per-token "
                         "off-policy share then counts only tokens served by an older version")
    ap.add_argument("--reload-gpu-s", type=float, default=2.0,
                    help="with --weight-sync: GPU seconds a weight load holds each engine (the sim profile's reload_s)")
    args = ap.parse_args()
    names = [c for c in args.only.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x]
    except ValueError:
        ap.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if args.in_flight < args.n:
        ap.error(f"--in-flight ({args.in_flight}) must hold at least one group (--n {args.n})")
    outcomes = []
    if args.from_json:
        outcomes = [Outcome(**o) for o in json.loads(args.from_json.read_text())]
        outcomes = [o for o in outcomes if o.config in names and o.seed in seeds]
    runs = [(name, seed) for seed in seeds for name in names] if not args.from_json else []
    jobs = 1 if args.clock == "wall" else max(1, min(args.jobs, len(runs)))
    with tempfile.TemporaryDirectory(prefix="prorl-table3-") as tmp:
        if jobs == 1:
            # Seed-major: on real time a slow patch of the machine spreads over the configurations.
            for name, seed in runs:
                print(f"running {name} seed {seed} ...", flush=True)
                outcomes.append(run_config(name, seed, args, Path(tmp)))
                report(outcomes[-1], args)
        else:
            # On simulated time runs in parallel cannot change each other's figures: one per core.
            import concurrent.futures
            import multiprocessing

            print(f"running {len(runs)} replays, {jobs} at a time ...", flush=True)
            with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
                futures = [pool.submit(run_config, name, seed, args, Path(tmp)) for name, seed in runs]
                for f in futures:
                    outcomes.append(f.result())
                    print(f"done {outcomes[-1].config} seed {outcomes[-1].seed}", flush=True)
                    report(outcomes[-1], args)
    title = (f"Table 3 replay: {BACKENDS} simulated H100/8B backends, {args.steps} DAPO steps, groups of {args.n}, "
             f"target {args.target}, {args.in_flight} in flight, "
             + ("simulated time" if args.clock == "simulated" else f"time x{args.speedup:g}") + f", seeds {seeds}"
             + (f", weight sync between steps ({args.reload_gpu_s:g} GPU-s loads)" if args.weight_sync else ""))
    print("\n" + title)
    print(f"{'config':<14}{'inst/s':>8}{'spread':>14}{'ratio':>7}{'spread':>12}{'busy':>6}{'spread':>10}"
          f"{'prefix hit':>11}   paper inst/s, util (ratio)")
    for o in outcomes:
        if o.skipped:
            print(f"{o.config:<14}skipped: {o.skipped}")
    for o in outcomes:
        if not o.skipped and o.overrun_fraction > 0.1:
            print(f"warning: {o.config} seed {o.seed}: {o.overrun_fraction:.0%} of its hop time was longer than the tool "
                  f"waits it had to come out of (calls {o.call_gap_gpu_s} GPU-s apart against {o.tool_mean_gpu_s} "
                  "modelled): this machine's CPU latency shows in its figures; rerun on a quieter machine or with a "
                  "lower --speedup")
    summaries = summarise(outcomes)
    for sm in summaries:
        paper = PAPER.get(sm.config)
        paper_s = f"{paper[0]}, {paper[1]:.0%} ({paper_ratio(sm.config):.2f})" if paper else "-"
        r = f"{sm.ratio:.2f}" if sm.ratio is not None else "-"
        rr = f"{sm.ratio_range[0]:.2f}-{sm.ratio_range[1]:.2f}" if sm.ratio_range else "-"
        print(f"{sm.config:<14}{sm.instances_per_s:>8.3f}{sm.instances_range[0]:>7.3f}-{sm.instances_range[1]:<6.3f}"
              f"{r:>7}{rr:>12}{sm.busy_fraction:>6.0%}{sm.busy_range[0]:>5.0%}-{sm.busy_range[1]:<4.0%}"
              f"{sm.prefix_hit_rate:>11.0%}   {paper_s}")
    useful = useful_work(outcomes)
    print("\nuseful work: informative groups per 1,000 GPU-s held (window x backends) and per 1,000 busy GPU-s "
          "(engine clocks); share of held GPU-s per job outcome")
    print(f"{'config':<14}{'inf/kGPU-s':>11}{'spread':>14}{'x sync':>7}{'spread':>12}{'x full':>7}{'inf/kbusy':>10}"
          f"{'off-pol':>8}{'stale tok':>10}{'recomp/call':>12}{'carried cr.':>12}{'x sync':>7}   shares")
    for u in useful:
        vs = f"{u.vs_sync:.2f}" if u.vs_sync is not None else "-"
        vsr = f"{u.vs_sync_range[0]:.2f}-{u.vs_sync_range[1]:.2f}" if u.vs_sync_range else "-"
        vf = f"{u.vs_full:.2f}" if u.vs_full is not None else "-"
        shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(u.shares.items(), key=lambda kv: -kv[1]) if v >= 0.005)
        print(f"{u.config:<14}{u.per_kgpu_s:>11.2f}{u.per_kgpu_s_range[0]:>7.2f}-{u.per_kgpu_s_range[1]:<6.2f}"
              f"{vs:>7}{vsr:>12}{vf:>7}{u.per_kbusy_s:>10.2f}{u.off_policy:>8.0%}{u.stale_tokens:>10.0%}{u.recomputed_per_call:>12.0f}"
              f"{u.per_kgpu_s_carried:>12.2f}{(f'{u.vs_sync_carried:.2f}' if u.vs_sync_carried else '-'):>7}   {shares}")
    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=2))
    if args.plot:
        plot(summaries, args.plot, title)
        print(f"plot: {args.plot}")
    if args.plot_breakdown:
        plot_breakdown(useful, args.plot_breakdown, title)
        print(f"plot: {args.plot_breakdown}")
    if args.plot_pareto:
        plot_pareto(useful, outcomes, args.plot_pareto, title)
        print(f"plot: {args.plot_pareto}")


if __name__ == "__main__":
    main()
