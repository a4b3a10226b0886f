"""GRPO through the gateway: an unmodified OpenAI-SDK agent program learns to use its calculator.

    python examples/train_harness_grpo.py --out runs/harness --seed 0       # the full run, embedded (minutes)
    python examples/train_harness_grpo.py --out /tmp/h --short              # the CI configuration
    python examples/train_harness_grpo.py --out $SHARED/run --warmup-only   # write OUT/checkpoints/v0, exit
    python examples/train_harness_grpo.py --out $SHARED/run --deployment NAME   # train on a launched deployment

The task and the recipe are ``train_tiny_grpo.py``'s (the same one-digit ``a + b`` / ``a - b``
problems, the same supervised warm-up that teaches both ways, calling the tool or guessing, then GRPO
steps with :class:`~prorl_cli.training.sampler.BlockingDapoSampler`, weight sync between steps), but
each rollout is a ``harness`` job: ``examples/agents/calculator_agent.py``, a plain ``openai`` program
that knows nothing of prorl, runs in the job's sandbox and talks to the job's gateway through
``OPENAI_BASE_URL``; the gateway's hermes parser turns the model's ``<tool_call>`` output into
OpenAI ``tool_calls``, and ``scorer: math`` grades the final ``\\boxed{}``. The warm-up renders its
demonstrations from the agent's own system prompt and tool schema, so they are token for token
what the gateway renders for the agent's requests (``summary.json``: ``warmup_prompt_match``).

Training samples come from ``samples_from_results``: the gateway records every call token-exactly,
and the run stops with an error if a rollout's continuity is below 1.0 or a call was re-tokenized
(a recorded history edit), since this agent never edits its conversation.

Without ``--deployment`` an embedded ``LocalStack`` (broker, node, a transformers bridge) runs on
this machine. With ``--deployment NAME`` the script joins a deployment already launched (found as
``prorl submit -d NAME`` finds it: ``PRORL_HOME``, prorl.yaml), starts no bridge, begins from
``--init-from`` (default ``OUT/checkpoints/v0``), and after each update saves
``OUT/checkpoints/v<k>`` and has the broker hand it to every bridge (``update_weights``): OUT must be
on a filesystem the bridges read.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The sibling examples (this script's folder is on sys.path when it is run as a script).
import reward_plots
import train_tiny_grpo as tiny

os.environ.setdefault("OMP_NUM_THREADS", "1")

TASK = "harness"
AGENT = Path(__file__).resolve().parent / "agents" / "calculator_agent.py"
#: Where the shipped test images live (``scripts/provision/47-harness-image.sh`` builds ``harness``).
TEST_IMAGES = Path(os.environ.get("PRORL_TEST_IMAGES", "/var/cache/prorl-test"))


@functools.cache
def load_agent() -> Any:
    """The agent program as a module (its ``SYSTEM`` and ``TOOLS``: what the warm-up must render)."""
    spec = importlib.util.spec_from_file_location("calculator_agent", AGENT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class HarnessRunConfig(tiny.RunConfig):
    #: Join this launched deployment instead of starting an embedded one.
    deployment: str | None = None
    #: Stop after writing ``OUT/checkpoints/v0`` (the weights a deployment's bridges start on).
    warmup_only: bool = False
    #: Embedded stack only: ``sandbox.runtime`` of its node (auto, apptainer, bwrap, local).
    sandbox_runtime: str = "auto"
    #: The sandbox image with python3 and the ``openai`` package ("" : the test image, else ``harness``).
    image: str = ""
    #: The interpreter that runs the agent inside the sandbox ("" : python3; the local runtime: this one).
    agent_python: str = ""
    #: Per-rollout limit on the agent program.
    agent_timeout_s: float = 120.0
    #: Rollouts running at once (default two groups): each is a sandboxed Python process importing the SDK.
    max_in_flight: int | None = None


@dataclass
class HarnessRunSummary(tiny.RunSummary):
    #: Lowest ``output["continuity"]`` over the rollouts trained on (1.0: every call extended its conversation).
    continuity: float = 1.0
    #: Calls recorded as history edits (``trajectory.violations``), i.e. re-rendered rather than extended.
    retokenized_calls: int = 0
    #: Backend id -> the policy version it reports after the last weight sync.
    bridge_versions: dict[str, int | None] = field(default_factory=dict)
    #: Whether the gateway's first prompt of every rollout was token for token the warm-up's prompt.
    warmup_prompt_match: bool = True
    #: Per step, the samples that merged two or more model calls (a tool call, then the answer after its result).
    merged_samples: list[int] = field(default_factory=list)
    deployment: str | None = None


def demonstration(chat: Any, problem: dict[str, Any], use_tool: bool, rng: Any,
                  guess_range: tuple[int, int] = (10, 99)) -> tuple[list[int], list[int]]:
    """One warm-up episode of the agent's conversation: ids and loss mask (``tiny.demonstration``'s, with ``\\boxed``).

    The prompt is the agent's (its system prompt, its tool schema via ``chat``); the tool episode's
    second prompt is the gateway's continuation rule (sampled ids, then the tool message rendered).
    """
    agent = load_agent()
    messages = [{"role": "system", "content": agent.SYSTEM}, {"role": "user", "content": problem["question"]}]
    eos = chat.stop_token_ids
    prompt = chat.initial_prompt(messages)
    if not use_tool:
        out = chat.encode(f"The answer is \\boxed{{{rng.randint(*guess_range)}}}.") + eos
        return prompt + out, [0] * len(prompt) + [1] * len(out)
    call = {"name": "calculator", "arguments": {"expression": problem["expression"]}}
    out1 = chat.encode(f"<tool_call>\n{json.dumps(call)}\n</tool_call>") + eos
    delta = chat.continuation(out1, [{"role": "tool", "tool_call_id": "call_0", "content": problem["answer"]}])
    out2 = chat.encode(f"The answer is \\boxed{{{problem['answer']}}}.") + eos
    ids = prompt + out1 + delta + out2
    return ids, [0] * len(prompt) + [1] * len(out1) + [0] * len(delta) + [1] * len(out2)


def agent_instance(problem: dict[str, Any], cfg: HarnessRunConfig, tokenizer_dir: Path) -> dict[str, Any]:
    """A ``harness`` task instance: the problem, and the agent program as the command.

    The image ships python3 and ``openai``, not this example's program, so the command carries its
    source (``python3 -c SOURCE TASK_FILE``); a harness installed in the image is named directly.
    """
    python = cfg.agent_python or (sys.executable if cfg.sandbox_runtime == "local" and not cfg.deployment
                                  else "python3")
    command = f"{shlex.quote(python)} -c {shlex.quote(AGENT.read_text())} {{task_file}}"
    image = cfg.image or (str(TEST_IMAGES / "harness") if (TEST_IMAGES / "harness").is_dir() else "harness")
    return {
        "question": problem["question"], "answer": problem["answer"], "expression": problem["expression"],
        "tokenizer": str(tokenizer_dir),
        # A task file per problem: the local runtime's jobs share the host's /tmp (a group's jobs write the same text).
        "settings": {"image": image, "command": command, "scorer": "math", "workdir": "/tmp/calc",
                     "task_file": f"/tmp/prorl-calc-{problem['expression'].replace(' ', '')}.md",
                     "timeout_s": cfg.agent_timeout_s, "poll_s": 0.1},
    }


def used_tool(result: Any) -> bool:
    """Whether the agent called the calculator: its first reply was a tool call, so a second call followed."""
    return len(((result.output or {}).get("trajectory") or {}).get("calls", [])) > 1


def evaluate(client: Any, held_out: list[dict[str, Any]], cfg: HarnessRunConfig, tag: str) -> tuple[float, float]:
    """(mean reward, share of episodes that called the calculator) on the held-out instances (fixed seeds)."""
    from prorl_cli.protocol import JobSpec, SamplingParams

    specs, instances = [], []
    for i, inst in enumerate(held_out):
        for k in range(cfg.eval_samples):
            sampling = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=1000 * i + k)
            specs.append(JobSpec(job_id=f"heval-{cfg.seed}-{tag}-{i}-{k}", task=TASK, timeout_s=600,
                                 sampling=sampling))
            instances.append(inst)
    client.submit_specs(specs, instances)
    results = client.wait([s.job_id for s in specs], timeout_s=1800)
    return (sum(float(r.reward or 0.0) for r in results) / len(results),
            sum(used_tool(r) for r in results) / len(results))


def check_token_exact(results: list[Any], summary: HarnessRunSummary, prompts: set[tuple[int, ...]]) -> None:
    """Record continuity and re-tokenized calls; raise if any rollout is not token-exact."""
    from prorl_cli.exceptions import ProrlError

    bad = []
    for r in results:
        out = r.output if isinstance(r.output, dict) else {}
        traj = out.get("trajectory")
        if traj is None or r.reward is None:
            continue  # no sample comes from it (samples_from_results skips it too)
        continuity = float(out.get("continuity", 0.0))
        edits = len(traj.get("violations") or [])
        summary.continuity = min(summary.continuity, continuity)
        summary.retokenized_calls += edits
        calls = traj.get("calls") or []
        if calls and tuple(calls[0]["prompt_ids"]) not in prompts:
            summary.warmup_prompt_match = False
        if continuity < 1.0 or edits:
            bad.append(f"{r.job_id}: continuity {continuity}, {edits} edit(s): {traj.get('violations')}")
    if bad:
        raise ProrlError("rollouts that are not token-exact (this agent never edits its history):\n" + "\n".join(bad))


def bridge_versions(client: Any, updated: list[str], version: int) -> dict[str, int | None]:
    """Backend id -> policy version of every live bridge, as the broker's status reports it.

    A broker whose status does not carry bridges' versions: the bridges that confirmed loading
    ``version`` (``update_weights``'s ``updated``) have it; the others are unknown (None).
    """
    out: dict[str, int | None] = {}
    for b in client.status().backends:
        if b.kind != "bridge" or not b.alive:
            continue
        reported = getattr(b, "policy_version", None)
        out[b.backend_id] = int(reported) if reported is not None else (version if b.backend_id in updated else None)
    return out


def _load(path: str, device: str) -> Any:
    """The causal LM at ``path``, in float32 (as the warm-up cache saves it), on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device)


def run(cfg: HarnessRunConfig) -> HarnessRunSummary:
    import random

    import torch

    from prorl_cli.agent import ChatTokens
    from prorl_cli.inference.device import resolve_device
    from prorl_cli.inference.tiny_model import make_tiny_model

    started = time.monotonic()
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)  # the node and the bridge need the other core
    cfg.out.mkdir(parents=True, exist_ok=True)
    agent = load_agent()
    device = resolve_device(cfg.device)
    every = tiny.problems(rng)
    held_out, train = every[:cfg.n_eval], every[cfg.n_eval:]
    summary = HarnessRunSummary(seed=cfg.seed, deployment=cfg.deployment)
    v0 = cfg.out / "checkpoints" / "v0"
    init_from = cfg.init_from or (v0 if cfg.deployment else None)
    if init_from is not None:
        if not (init_from / "config.json").is_file():
            from prorl_cli.exceptions import ConfigError

            raise ConfigError(f"--init-from {init_from}: no model there (run with --warmup-only first)")
        tok_dir = init_from
        chat = ChatTokens.from_pretrained(tok_dir, tools=agent.TOOLS)
        model = _load(str(init_from), device)
        print(f"warm-up skipped: weights from {init_from}", flush=True)
    else:
        tok_dir = make_tiny_model(cfg.out / "model-init", seed=cfg.seed)
        chat = ChatTokens.from_pretrained(tok_dir, tools=agent.TOOLS)
        model = _load(str(tok_dir), device)
        model, summary.warmup_steps, summary.warmup_copy_acc, summary.warmup_p_tool = tiny.warm_up_cached(
            model, chat, train, cfg, rng, demonstration)
        print(f"warm-up: {summary.warmup_steps} supervised steps, copy accuracy {summary.warmup_copy_acc:.2f}, "
              f"P(tool call first) {summary.warmup_p_tool:.2f} ({time.monotonic() - started:.0f} s)", flush=True)
    print(f"training on {device}", flush=True)

    def checkpoint(version: int) -> Path:
        path = cfg.out / "checkpoints" / f"v{version}"
        model.save_pretrained(str(path))
        chat.tokenizer.save_pretrained(str(path))
        return path

    if cfg.warmup_only:
        print(f"warm-up written to {checkpoint(0)}", flush=True)
        _write(cfg, summary, started)
        return summary

    # What the warm-up trained on as each problem's first prompt (the gateway must render the same).
    prompts = {tuple(chat.initial_prompt([{"role": "system", "content": agent.SYSTEM},
                                          {"role": "user", "content": p["question"]}])) for p in every}
    train_inst = [agent_instance(p, cfg, tok_dir) for p in train]
    held_inst = [agent_instance(p, cfg, tok_dir) for p in held_out]
    if cfg.deployment:
        from prorl_cli.client import RolloutClient
        from prorl_cli.config import load_config

        client = RolloutClient(cfg.deployment, config=load_config(None, {"deployment": cfg.deployment}))
        try:
            client.ping(timeout_s=10)
            _train(cfg, summary, client, None, model, checkpoint, train_inst, held_inst, prompts, started)
        finally:
            client.close()
    else:
        from prorl_cli.embedded import LocalStack

        config: dict[str, Any] = {"log_level": "WARNING", "node": {"n_init": 4, "n_run": 8, "n_eval": 4},
                                  "sandbox": {"runtime": cfg.sandbox_runtime}}
        if cfg.sandbox_runtime == "local":
            # The local runtime shares the host's /tmp, where every harness job keeps its script and log:
            # one job at a time.
            config["node"] = {"n_init": 1, "n_run": 1, "n_eval": 1}
        with LocalStack(cfg.out / "stack", f"hgrpo{cfg.seed}", config) as stack:
            stack.start_broker()
            stack.start_node("node")
            bridge = tiny.Bridge(stack)
            bridge.serve(checkpoint(0), 0)
            _train(cfg, summary, stack.client, bridge, model, checkpoint, train_inst, held_inst, prompts, started)
    return summary


def _train(cfg: HarnessRunConfig, summary: HarnessRunSummary, client: Any, bridge: Any, model: Any,
           checkpoint: Any, train: list[dict[str, Any]], held_out: list[dict[str, Any]],
           prompts: set[tuple[int, ...]], started: float) -> None:
    """Held-out evaluation, then GRPO steps with a weight sync after each (the bridge's, or the broker's)."""
    import torch

    from prorl_cli.training.export import write_samples_jsonl, write_samples_parquet
    from prorl_cli.training.sampler import BlockingDapoSampler, SamplerConfig
    from prorl_cli.training.samples import samples_from_results

    version = 0
    reward, tools = evaluate(client, held_out, cfg, "v0")
    summary.curve.append((0, reward))
    summary.tool_use.append((0, tools))
    print(f"step 0: held-out reward {reward:.3f}, tool use {tools:.2f} ({time.monotonic() - started:.0f} s)", flush=True)
    sampler = BlockingDapoSampler(client, TASK, train, SamplerConfig(
        group_size=cfg.group_size, target_groups=cfg.target_groups, run_id=f"hgrpo{cfg.seed}",
        max_in_flight=cfg.max_in_flight or 2 * cfg.group_size, carry_over=False,
        # The run's seed numbers its rollouts (each gets its own): a rerun samples the same ones.
        sampling={"max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "seed": cfg.seed},
        max_staleness=1, timeout_s=600, step_timeout_s=3600,
    ))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    samples: list[Any] = []
    try:
        for step in range(1, cfg.steps + 1):
            batch = sampler.step(policy_version=version)
            check_token_exact(batch.results, summary, prompts)
            built = samples_from_results(batch.results, group_of=batch.group_of)
            samples = built.samples
            summary.merged_samples.append(sum(len(s.calls) > 1 for s in samples))
            calls = [c for r in batch.results for c in r.output["trajectory"]["calls"]]
            summary.policy_versions_seen.append(
                sorted({c["policy_version"] for c in calls if c.get("policy_version") is not None}))
            summary.backends_seen.append(sorted({str(c.get("backend_id")) for c in calls}))
            before = tiny.flat_params(model)
            losses = [tiny.grpo_update(model, opt, samples, cfg.clip_eps) for _ in range(cfg.ppo_epochs)]
            summary.weight_deltas.append(float((tiny.flat_params(model) - before).norm()))
            summary.losses.append(losses[0])
            summary.train_rewards.append(sum(r.reward or 0.0 for r in batch.results) / max(1, len(batch.results)))
            summary.merge_ratio.append(built.report.merge_ratio)
            summary.filtered.append(batch.stats.filtered)
            # Weight sync: no call in flight, the new checkpoint loaded in place, generation resumed under it.
            version += 1
            with client.generation_paused(version, drain_timeout_s=300):
                path = checkpoint(version)
                if bridge is not None:
                    bridge.serve(path, version)
                    updated = [b.backend_id for b in client.status().backends if b.kind == "bridge" and b.alive]
                else:
                    updated = list(client.update_weights(path, policy_version=version).updated)
            summary.bridge_versions = bridge_versions(client, updated, version)
            line = (f"step {step}: loss {losses[0]:+.4f}, train reward {summary.train_rewards[-1]:.3f}, "
                    f"train tool use {sum(used_tool(r) for r in batch.results) / max(1, len(batch.results)):.2f}, "
                    f"filtered {batch.stats.filtered}, |dW| {summary.weight_deltas[-1]:.4f}, "
                    f"mean stage s {_stage_means(batch.results)}")
            if step % cfg.eval_every == 0 or step == cfg.steps:
                reward, tools = evaluate(client, held_out, cfg, f"v{version}")
                summary.curve.append((step, reward))
                summary.tool_use.append((step, tools))
                line += f", held-out reward {reward:.3f}, tool use {tools:.2f}"
            print(line + f" ({time.monotonic() - started:.0f} s)", flush=True)
    finally:
        sampler.close()
    write_samples_jsonl(cfg.out / "samples.jsonl", samples)
    write_samples_parquet(cfg.out / "samples.parquet", samples)
    _write(cfg, summary, started)
    reward_plots.plot_run(cfg.out / "reward_curve.png", summary.curve, summary.train_rewards, summary.tool_use)
    print("reward curve (step, held-out mean reward): " + ", ".join(f"({s}, {r:.3f})" for s, r in summary.curve))


def _stage_means(results: list[Any]) -> str:
    """Mean seconds per stage over ``results`` (``init 1.2 run 3.4 eval 0.1``): where a step's time went."""
    stages = ("init", "run", "eval")
    n = max(1, len(results))
    return " ".join(f"{s} {sum(float(r.stage_s.get(s, 0.0)) for r in results) / n:.1f}" for s in stages)


def _write(cfg: HarnessRunConfig, summary: HarnessRunSummary, started: float) -> None:
    summary.wall_s = time.monotonic() - started
    (cfg.out / "summary.json").write_text(json.dumps(asdict(summary), indent=1))
    (cfg.out / "curve.json").write_text(json.dumps(summary.curve))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/harness-grpo"),
                    help="run directory: checkpoints/v<k>, summary.json, curve.json, samples (default runs/harness-grpo)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, help="GRPO steps (default 10; --short: 2)")
    ap.add_argument("--warmup-steps", type=int, help="cap on supervised warm-up steps (default 1600; --short: 120)")
    ap.add_argument("--short", action="store_true", help="the CI configuration: 2 GRPO steps, a small eval")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="where the policy trains: auto (the GPU when torch sees one, else the CPU)")
    ap.add_argument("--warmup-only", action="store_true",
                    help="do the warm-up, write OUT/checkpoints/v0 (model and tokenizer) and exit")
    ap.add_argument("--init-from", type=Path,
                    help="skip the warm-up: start from this model directory (with --deployment: default "
                         "OUT/checkpoints/v0)")
    ap.add_argument("--deployment", metavar="NAME",
                    help="train on this launched deployment (found as 'prorl -d NAME submit' finds it); no "
                         "bridge is started, each update reaches every bridge through update_weights")
    ap.add_argument("--warmup-cache", type=Path, help="keep and reuse warm-up checkpoints here (per seed and settings)")
    ap.add_argument("--sandbox-runtime", default="auto", choices=("auto", "apptainer", "bwrap", "local"),
                    help="embedded stack: the node's sandbox runtime (local: no isolation, one job at a time)")
    ap.add_argument("--image", default="",
                    help="sandbox image with python3 and the openai package (default: the provisioned test "
                         "image $PRORL_TEST_IMAGES/harness when present, else the manifest's 'harness')")
    ap.add_argument("--agent-python", default="", help="the interpreter that runs the agent in the sandbox")
    ap.add_argument("--plot-seeds", type=int, metavar="N",
                    help="only aggregate the runs OUT/seed-K (K = SEED..SEED+N-1): print the held-out reward's "
                         "mean and spread per evaluation, plot them to OUT/reward_curve_seeds.png")
    args = ap.parse_args(argv)
    if args.plot_seeds:
        runs: list[tiny.RunSummary] = [HarnessRunSummary(seed=k, curve=json.loads((args.out / f"seed-{k}" / "summary.json").read_text())["curve"])
                for k in range(args.seed, args.seed + args.plot_seeds)]
        tiny.aggregate(runs, args.out / "reward_curve_seeds.png")
        return 0
    if args.warmup_only and args.deployment:
        ap.error("--warmup-only makes the starting weights; it does not train (drop --deployment)")
    # Absolute: checkpoint and tokenizer paths go to bridges and nodes, which run elsewhere (other cwd, other hosts).
    cfg = HarnessRunConfig(out=args.out.resolve(), seed=args.seed, device=args.device, deployment=args.deployment,
                           warmup_only=args.warmup_only, sandbox_runtime=args.sandbox_runtime, image=args.image,
                           agent_python=args.agent_python)
    if args.short:
        # train_tiny_grpo's CI configuration: a capped warm-up and one-digit guesses give the groups variance.
        cfg.guess_range = (1, 9)
        cfg.steps, cfg.warmup_steps, cfg.n_eval, cfg.eval_samples, cfg.eval_every = 2, 120, 4, 1, 2
        # One informative group of 4 per step, one group at a time: a rollout's cost is its agent process
        # (start and SDK import, ~1.5 s of CPU), and a group submitted beside it is mostly cancelled work.
        cfg.target_groups, cfg.group_size, cfg.max_in_flight = 1, 4, 4
    if args.steps is not None:
        cfg.steps = args.steps
    if args.warmup_steps is not None:
        cfg.warmup_steps = args.warmup_steps
    cfg.init_from = args.init_from.resolve() if args.init_from is not None else None
    # Warm-ups of this example's conversation are not train_tiny_grpo's: a cache folder of their own.
    cfg.warmup_cache = args.warmup_cache / "harness" if args.warmup_cache is not None else None
    from prorl_cli.exceptions import BrokerUnavailable, ConfigError, RendezvousError, SamplerError

    try:
        summary = run(cfg)
    # Bad input, no deployment, or a step the sampler stopped (rewards that never vary, every rollout failing; the
    # message says which, with the failures' reason): one line, no traceback.
    except (ConfigError, RendezvousError, BrokerUnavailable, SamplerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if all(math.isfinite(x) for x in summary.losses) else 1


if __name__ == "__main__":
    raise SystemExit(main())
