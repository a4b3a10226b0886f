"""TRL's GRPOTrainer on the CPU, with prorl as its rollout engine: the tiny model learns the calculator task.

The same task, model and warm-up as ``examples/train_tiny_grpo.py`` (whose
functions it reuses), with TRL's trainer instead of that example's own loop:

1. ``prorl dev tiny-model`` weights and the supervised warm-up (or
   ``--init-from`` a directory with warmed-up weights, e.g. the other
   example's ``checkpoints/v0``; or ``--warmup-cache DIR``, shared with the
   other example: the same seed and settings load the same checkpoint).
2. A real prorl deployment on this machine (broker, node with the
   ``math_agent`` handler, a transformers-engine bridge on the warm-up
   checkpoint).
3. ``trl.GRPOTrainer`` with ``rollout_func=ProrlRollout(client, "math_agent", ...)``
   and ``reward_funcs=[prorl_reward]``: each prompt group runs as prorl jobs
   (multi-turn, calculator tool; tool tokens masked out of the loss), and
   between steps the trainer's weights go into the running bridge in place
   (pause that drains, ``update_weights``, resume under the new version).
4. Held-out mean reward and tool use every ``--eval-every`` steps (the same
   evaluation as the other example), saved as ``curve.json``,
   ``summary.json`` and ``reward_curve.png``; ``--seeds N`` runs N seeds
   and plots mean and spread (``--plot-only`` aggregates seeds run apart;
   ``--compare TINY_OUT`` adds the other example's seeds to a second plot).

The GRPO settings are the other example's as far as TRL has them: groups of
8, 4 groups per step, temperature 0.7 (prorl samples), lr 2e-4 constant,
one epoch clipped at 0.2, gradient norm 1, advantages ``r - mean(group)``
(``scale_rewards="none"``), each rollout's token-mean averaged over
rollouts (``loss_type="grpo"``). What TRL cannot do: drop a group whose
rewards are all equal and sample another (TRL fixes the prompts of a step
before the rollouts), so some of its 4 groups per step teach nothing.

    python examples/train_trl_grpo.py --out /tmp/trl-grpo --short       # CI: 2 steps
    python examples/train_trl_grpo.py --out /tmp/trl-grpo --seeds 3     # 3 seeds, each warms up itself

Against the other example, from the same warm-ups (docs/training.md), for K in 0 1 2:

    python examples/train_tiny_grpo.py --out runs/tiny/seed-K --seed K --warmup-cache runs/warmups
    python examples/train_trl_grpo.py --out runs/trl/seed-K --seed K --warmup-cache runs/warmups
    python examples/train_trl_grpo.py --out runs/trl --seeds 3 --plot-only --compare runs/tiny
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL

# The sibling examples (this script's folder is on sys.path when it is run as a script), after the
# settings above, which must come before anything imports torch or TRL.
import reward_plots  # noqa: E402  (the reward-curve plots both examples draw)
import train_tiny_grpo as tiny  # noqa: E402  (the shared task, warm-up and evaluation)


@dataclass
class TrlSummary:
    seed: int
    warmup_steps: int = 0
    #: The weights the run started from (``--init-from``, or the warm-up cache entry); None: warmed up itself.
    init_from: str | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)
    tool_use: list[tuple[int, float]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    train_rewards: list[float] = field(default_factory=list)
    policy_versions_seen: list[list[int]] = field(default_factory=list)
    merge_ratio: list[float] = field(default_factory=list)
    masked_tokens: list[int] = field(default_factory=list)
    #: Per step: groups whose rewards were not all equal (the others have advantage 0 throughout).
    informative_groups: list[int] = field(default_factory=list)
    weight_delta: float = 0.0
    wall_s: float = 0.0


def run(cfg: tiny.RunConfig) -> TrlSummary:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from prorl_cli.agent import ChatTokens
    from prorl_cli.embedded import LocalStack
    from prorl_cli.handlers.math_agent import CALCULATOR_SCHEMA
    from prorl_cli.inference.device import resolve_device
    from prorl_cli.inference.tiny_model import make_tiny_model
    from prorl_cli.integrations.trl import ProrlRollout, prorl_reward

    started = time.monotonic()
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)  # the node and the bridge need the other core
    cfg.out.mkdir(parents=True, exist_ok=True)
    init_dir = make_tiny_model(cfg.out / "model-init", seed=cfg.seed)
    chat = ChatTokens.from_pretrained(init_dir, tools=[CALCULATOR_SCHEMA])
    every = tiny.problems(rng)
    held_out, train = every[:cfg.n_eval], every[cfg.n_eval:]
    for p in train + held_out:
        p["tokenizer"] = str(init_dir)
        p["max_turns"] = 3
    summary = TrlSummary(seed=cfg.seed)
    device = resolve_device(cfg.device)
    print(f"training on {device}", flush=True)
    if cfg.init_from is not None:
        model = AutoModelForCausalLM.from_pretrained(str(cfg.init_from), dtype=torch.float32).to(device)
        summary.init_from = str(cfg.init_from)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(init_dir), dtype=torch.float32).to(device)
        model, summary.warmup_steps, _, _ = tiny.warm_up_cached(model, chat, train, cfg, rng)
        if cfg.warmup_cache is not None:
            summary.init_from = str(cfg.warmup_cache / tiny.warmup_cache_key(cfg))
        print(f"warm-up: {summary.warmup_steps} steps ({time.monotonic() - started:.0f} s)", flush=True)
    start_dir = cfg.out / "checkpoints" / "v0"
    model.save_pretrained(str(start_dir))
    chat.tokenizer.save_pretrained(str(start_dir))
    before = tiny.flat_params(model)  # on the CPU: TRL may move the model
    by_question = {p["question"]: p for p in train}

    with LocalStack(cfg.out / "stack", f"trl{cfg.seed}", {"log_level": "WARNING", "node": {"n_init": 4, "n_run": 8, "n_eval": 4}}) as stack:
        stack.start_broker()
        stack.start_node("node")
        tiny.Bridge(stack).serve(start_dir, 0)
        client = stack.client
        rollout = ProrlRollout(
            client, tiny.TASK, instance_of=by_question.__getitem__,
            sampling={"max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "seed": cfg.seed},
            checkpoint_dir=cfg.out / "checkpoints", timeout_s=300, run_id=f"trl{cfg.seed}",
        )
        reward, tools = tiny.evaluate(client, held_out, cfg, "v0")
        summary.curve.append((0, reward))
        summary.tool_use.append((0, tools))
        print(f"step 0: held-out reward {reward:.3f}, tool use {tools:.2f}", flush=True)
        holder: dict[str, Any] = {}

        class HeldOut(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if state.global_step % cfg.eval_every and state.global_step != cfg.steps:
                    return
                rollout.sync(holder["trainer"])  # the bridge serves the weights this step made
                r, t = tiny.evaluate(client, held_out, cfg, f"v{state.global_step}")
                summary.curve.append((state.global_step, r))
                summary.tool_use.append((state.global_step, t))
                print(f"step {state.global_step}: held-out reward {r:.3f}, tool use {t:.2f} "
                      f"({time.monotonic() - started:.0f} s)", flush=True)

        args = GRPOConfig(
            output_dir=str(cfg.out / "trl"), use_cpu=device == "cpu", max_steps=cfg.steps, seed=cfg.seed,
            per_device_train_batch_size=cfg.group_size * cfg.target_groups, num_generations=cfg.group_size,
            max_completion_length=256, learning_rate=cfg.lr, logging_steps=1, report_to="none",
            # TRL's log-probs at temperature 1: the engines' log-probs are of the unmodified distribution too.
            save_strategy="no",
            # The other example's update: one clipped epoch, r - mean(group) advantages, each rollout's
            # token-mean averaged over rollouts, a constant lr (TRL's default decays it to 0 over the run),
            # torch's AdamW weight decay, gradient norm clipped at 1.
            num_iterations=cfg.ppo_epochs, epsilon=cfg.clip_eps, scale_rewards="none", loss_type="grpo",
            lr_scheduler_type="constant", weight_decay=0.01, max_grad_norm=1.0, beta=0.0,
        )
        trainer = GRPOTrainer(
            model=model, reward_funcs=[prorl_reward], args=args,
            train_dataset=Dataset.from_dict({"prompt": [p["question"] for p in train]}),
            processing_class=chat.tokenizer, rollout_func=rollout, callbacks=[HeldOut()],
        )
        holder["trainer"] = trainer
        trainer.train()
    summary.losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    summary.train_rewards = [float(h["reward"]) for h in trainer.state.log_history if "reward" in h]
    summary.policy_versions_seen = [h.policy_versions for h in rollout.history]
    summary.merge_ratio = [h.merge_ratio for h in rollout.history]
    summary.masked_tokens = [h.masked_tokens for h in rollout.history]
    summary.informative_groups = [h.informative_groups for h in rollout.history]
    after = tiny.flat_params(model)
    summary.weight_delta = float((after - before).norm())
    summary.wall_s = time.monotonic() - started
    (cfg.out / "summary.json").write_text(json.dumps(asdict(summary), indent=1))
    (cfg.out / "curve.json").write_text(json.dumps(summary.curve))
    print("reward curve (step, held-out mean reward): " + ", ".join(f"({s}, {r:.3f})" for s, r in summary.curve))
    return summary


def load_runs(out: Path, seeds: range) -> list[tiny.RunSummary]:
    """The ``summary.json`` of ``OUT/seed-K`` for each seed (this example's or the other's), as the other example's summary."""
    names = {f.name for f in tiny.RunSummary.__dataclass_fields__.values()}
    runs = []
    for seed in seeds:
        data = json.loads((out / f"seed-{seed}" / "summary.json").read_text())
        runs.append(tiny.RunSummary(**{k: v for k, v in data.items() if k in names}))
    return runs


def compare(trl: list[tiny.RunSummary], own: list[tiny.RunSummary], path: Path) -> dict[str, Any]:
    """Mean and [min, max] per evaluation of both trainers' held-out reward; plots them to ``path`` and returns the table."""
    table: dict[str, Any] = {}
    spreads = []
    for name, label, runs in (("trl", "TRL GRPOTrainer", trl), ("train_tiny_grpo", "train_tiny_grpo's loop", own)):
        points = reward_plots.spread([r.curve for r in runs])
        table[name] = {"seeds": [r.seed for r in runs],
                       "points": [{"step": s, "mean": m, "min": lo, "max": hi} for s, m, lo, hi in points],
                       "curves": {str(r.seed): r.curve for r in runs}, "tool_use": {str(r.seed): r.tool_use for r in runs}}
        spreads.append((f"{label} (mean, {len(runs)} seeds)", points))
    reward_plots.plot_spreads(path, spreads)
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=1, help="run seeds SEED..SEED+N-1 (OUT/seed-K), then plot mean and spread")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--warmup-steps", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--eval-every", type=int)
    ap.add_argument("--init-from", type=Path, help="skip the warm-up: start from this model directory")
    ap.add_argument("--warmup-cache", type=Path,
                    help="keep the warm-up checkpoint here per seed and warm-up settings, and load it when there "
                         "(shared with examples/train_tiny_grpo.py)")
    ap.add_argument("--plot-only", action="store_true",
                    help="with --seeds: only aggregate the OUT/seed-K that runs (e.g. started side by side) wrote")
    ap.add_argument("--compare", type=Path, metavar="TINY_OUT",
                    help="with --seeds: also plot train_tiny_grpo's seeds in TINY_OUT/seed-K against these "
                         "(OUT/reward_curve_vs_tiny.png, OUT/comparison.json)")
    ap.add_argument("--short", action="store_true", help="the CI configuration: 2 GRPO steps, a small eval")
    ap.add_argument("--device", default="auto",
                    help="where TRL trains: auto (the GPU when torch sees one, else the CPU), cpu, cuda:N")
    args = ap.parse_args(argv)
    seeds = range(args.seed, args.seed + args.seeds)
    runs = []
    for seed in seeds:
        if args.plot_only:
            break
        cfg = tiny.RunConfig(out=args.out / f"seed-{seed}" if args.seeds > 1 else args.out, seed=seed,
                             device=args.device)
        if args.short:  # as the other example's CI run: a capped warm-up, lucky one-digit guesses give variance
            cfg.guess_range = (1, 9)
            cfg.steps, cfg.warmup_steps, cfg.n_eval, cfg.eval_samples, cfg.eval_every = 2, 120, 4, 1, 2
            cfg.target_groups, cfg.group_size = 2, 4
        for name in ("steps", "warmup_steps", "lr", "eval_every"):
            if getattr(args, name) is not None:
                setattr(cfg, name, getattr(args, name))
        cfg.init_from, cfg.warmup_cache = args.init_from, args.warmup_cache
        summary = run(cfg)
        reward_plots.plot_run(cfg.out / "reward_curve.png", summary.curve, summary.train_rewards, summary.tool_use)
        runs.append(tiny.RunSummary(seed=seed, curve=summary.curve))
        if not all(math.isfinite(x) for x in summary.losses):
            return 1
    if args.plot_only:
        runs = load_runs(args.out, seeds)
    if len(runs) > 1:
        tiny.aggregate(runs, args.out / "reward_curve_seeds.png")
        if args.compare is not None:
            table = compare(runs, load_runs(args.compare, seeds), args.out / "reward_curve_vs_tiny.png")
            (args.out / "comparison.json").write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
