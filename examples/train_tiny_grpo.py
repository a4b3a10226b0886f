"""A real RL loop on the CPU: the tiny model learns, with GRPO through prorl, to use the calculator.

    python examples/train_tiny_grpo.py --out runs/grpo --seed 0          # the full run (minutes)
    python examples/train_tiny_grpo.py --out /tmp/g --short              # the CI configuration

What happens:

1. ``prorl dev tiny-model`` weights (random) and a supervised warm-up on
   generated demonstrations of one-digit ``a + b`` / ``a - b`` problems,
   half of them ideal tool episodes (``<tool_call>{"name": "calculator",
   ...}</tool_call>``, then ``The answer is N.`` with the tool's result),
   half answering at once with a random two-digit guess. The warm-up runs until the
   model copies the digits of a tool episode (operands into the call, the
   result into the answer), so it can do both ways but does not know which
   one pays: it calls the tool about half the time.
2. A real deployment on this machine (``LocalStack``): broker, node running
   ``math_agent`` (calculator tool, token-exact trajectories) and an
   inference bridge with the transformers engine serving the checkpoint.
3. GRPO steps with :class:`prorl_cli.training.DapoSampler` (zero-variance
   groups filtered), samples merged token-exactly, rollout-level
   advantages, rollout-level token-mean loss weights, one clipped
   policy-gradient update per step.
4. Weight sync between steps, inside ``client.generation_paused(version)``
   (no call in flight during the block; generation resumes however it
   ends): save the checkpoint, ``update_weights`` (the running bridge
   loads it in place; restarting the bridge on it is the fallback for
   engines that cannot reload); generation resumes under the bumped
   policy version, which the bridge stamps on every generate reply
   (``ModelCall.policy_version``).
   The reward (``math_agent``: 1.0 for the right number) pays the tool
   episodes, so RL moves the decision towards the tool (``docs/training.md``).
5. Held-out mean reward and tool use after every ``eval_every`` steps; the curve is
   printed, saved as ``curve.json`` and plotted to ``reward_curve.png``
   (matplotlib), beside the last step's exports (``samples.jsonl``,
   ``samples.parquet``) and ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The examples' shared plots, beside this file (its folder is on sys.path when it is run as a script).
import reward_plots

# One thread per process: trainer, node and bridge share the cores, and spinning OpenMP threads
# of several processes on an oversubscribed CPU make every forward pass many times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")


#: Exact-match reward (1.0 for the right number, else 0.0), calculator tool, token-exact trajectories.
TASK = "math_agent"


@dataclass
class RunConfig:
    out: Path
    seed: int = 0
    #: Held-out problems (disjoint from the training ones) and sampled episodes per problem at each evaluation.
    n_eval: int = 16
    eval_samples: int = 4
    #: Share of warm-up demonstrations that call the calculator; the rest answer at once with a two-digit guess.
    warmup_tool_share: float = 0.5
    #: The direct answers' guesses are drawn from this range: two digits are never right (every answer
    #: has one); the CI configuration uses 1-9 so that lucky guesses give its short run reward variance.
    guess_range: tuple[int, int] = (10, 99)
    #: Upper bound on supervised warm-up steps; the warm-up stops earlier once the copies are learned.
    warmup_steps: int = 1600
    #: Mean teacher-forced probability of the right digit where a tool episode copies one (operands into
    #: the call, the result into the answer), on problems it does not train on, at which the warm-up stops.
    warmup_copy_target: float = 0.95
    #: Steps at a tenth of the lr after that, so the tool/no-tool split settles near ``warmup_tool_share``.
    warmup_settle_steps: int = 30
    warmup_batch: int = 16
    warmup_lr: float = 3e-3
    steps: int = 10
    group_size: int = 8
    target_groups: int = 4
    #: Small, single-epoch updates: at 1e-3 x 2 epochs (|dW| ~1 per step) RL moved the decision in two
    #: steps, then broke the copies and taught the model to answer its training problems from memory.
    lr: float = 2e-4
    ppo_epochs: int = 1
    #: Start from these weights instead of the warm-up (a directory a previous run wrote, e.g. checkpoints/v0).
    init_from: Path | None = None
    #: Keep warm-up checkpoints here, one per seed and warm-up settings (``warmup_cache_key``): a run whose
    #: checkpoint is there loads it instead of warming up; both examples share it, so a TRL run starts from
    #: exactly the weights this example's GRPO run of the same seed started from. The key does not cover
    #: the code (tiny model, problems, demonstrations): empty the directory after changing it.
    warmup_cache: Path | None = None
    clip_eps: float = 0.2
    #: Sampling temperature for training and held-out episodes: at 1.0 a third of tool episodes miscopy.
    temperature: float = 0.7
    max_tokens: int = 40
    eval_every: int = 2
    #: Where the policy trains: ``auto`` is the GPU when torch sees one, else the CPU (``cpu``, ``cuda:N``).
    #: The bridge's transformers engine picks its own device the same way (``inference.device``).
    device: str = "auto"

    def __post_init__(self) -> None:
        # Checkpoint paths go to the bridge, a process started in the stack's own folder: a relative one would
        # name a folder under it.
        self.out = Path(self.out).resolve()


@dataclass
class RunSummary:
    seed: int
    warmup_steps: int = 0
    #: After the warm-up: teacher-forced copy accuracy and P(first answer token opens a tool call).
    warmup_copy_acc: float = 0.0
    warmup_p_tool: float = 0.0
    curve: list[tuple[int, float]] = field(default_factory=list)
    #: Per evaluation: the share of held-out episodes that called the calculator (the decision RL learns).
    tool_use: list[tuple[int, float]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    train_rewards: list[float] = field(default_factory=list)
    weight_deltas: list[float] = field(default_factory=list)
    policy_versions_seen: list[list[int]] = field(default_factory=list)
    backends_seen: list[list[str]] = field(default_factory=list)
    merge_ratio: list[float] = field(default_factory=list)
    filtered: list[int] = field(default_factory=list)
    wall_s: float = 0.0


def problems(rng: random.Random) -> list[dict[str, Any]]:
    """Every ``a + b`` and ``a - b`` (1 <= a, b <= 9) whose result is one digit 1-9 (72), shuffled by ``rng``.

    One-digit operands and results keep every copy a single token at a fixed offset, which the
    2-layer model learns in ~450-1,400 warm-up steps, seed-dependent (two-digit operands: mostly not within 800).
    The warm-up probes copying on problems it never trains on, so memorised answers do not count.
    """
    out = []
    for a in range(1, 10):
        for b in range(1, 10):
            for op, value in (("+", a + b), ("-", a - b)):
                if 1 <= value <= 9:
                    expr = f"{a} {op} {b}"
                    out.append({"question": f"What is {expr}?", "answer": str(value), "expression": expr})
    rng.shuffle(out)
    return out


def demonstration(chat: Any, problem: dict[str, Any], use_tool: bool, rng: random.Random,
                  guess_range: tuple[int, int] = (10, 99)) -> tuple[list[int], list[int]]:
    """Ids and loss mask of one episode, built turn by turn exactly as the agent loop builds prompts.

    ``use_tool``: call the calculator, then answer with its result (right). Otherwise answer at once
    with a random number from ``guess_range`` (two digits: never right), so a guess earns 0 and a
    tool episode earns what its copies get right. The warm-up teaches both ways; RL has to find out
    which one pays.
    """
    from prorl_cli.handlers.math_agent import SYSTEM

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": problem["question"]}]
    eos = chat.stop_token_ids
    prompt = chat.initial_prompt(messages)
    if not use_tool:
        # Two digits: a one-digit guess was right one time in nine, more than the tool episodes of a
        # model whose copies were still unreliable, and RL then learned to stop using the tool.
        out = chat.encode(f"The answer is {rng.randint(*guess_range)}.") + eos
        return prompt + out, [0] * len(prompt) + [1] * len(out)
    call = {"name": "calculator", "arguments": {"expression": problem["expression"]}}
    out1 = chat.encode(f"<tool_call>\n{json.dumps(call)}\n</tool_call>") + eos
    delta = chat.continuation(out1, [{"role": "tool", "name": "calculator", "content": problem["answer"]}])
    out2 = chat.encode(f"The answer is {problem['answer']}.") + eos
    ids = prompt + out1 + delta + out2
    mask = [0] * len(prompt) + [1] * len(out1) + [0] * len(delta) + [1] * len(out2)
    return ids, mask


#: Builds one warm-up episode: ``(chat, problem, use_tool, rng, guess_range) -> (ids, loss mask)``
#: (:func:`demonstration` here; ``train_harness_grpo.py`` passes its agent program's own).
Demo = Callable[[Any, dict[str, Any], bool, random.Random, tuple[int, int]], tuple[list[int], list[int]]]


def _batch(chat: Any, demos: list[tuple[list[int], list[int]]]) -> tuple[Any, Any]:
    import torch

    width = max(len(ids) for ids, _ in demos)
    pad = int(chat.tokenizer.pad_token_id or 0)
    ids_t = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in demos])
    mask_t = torch.tensor([m + [0] * (width - len(m)) for _, m in demos], dtype=torch.bool)
    return ids_t, mask_t


def _masked_logits(model: Any, ids_t: Any, mask_t: Any) -> tuple[Any, Any]:
    """Logits and targets at the trained positions only: the LM head over all ~250 positions dominated the step."""
    ids_t, mask_t = ids_t.to(model.device), mask_t.to(model.device)
    hidden = model.model(input_ids=ids_t).last_hidden_state[:, :-1]
    sel = mask_t[:, 1:]
    return model.lm_head(hidden[sel]), ids_t[:, 1:][sel]


def warmup_probe(model: Any, chat: Any, probe: list[dict[str, Any]], rng: random.Random,
                 demo: Demo = demonstration) -> tuple[float, float]:
    """(mean teacher-forced P(right digit) where tool episodes copy one, mean P(first answer token is ``<tool_call>``))."""
    import torch

    digit_ids = {i for d in "0123456789" for i in chat.encode(d)}
    ids_t, mask_t = (t.to(model.device) for t in _batch(chat, [demo(chat, p, True, rng, (10, 99)) for p in probe]))
    model.eval()
    with torch.no_grad():
        hidden = model.model(input_ids=ids_t).last_hidden_state  # one forward pass for both figures
        sel = mask_t[:, 1:]
        logits, targets = model.lm_head(hidden[:, :-1][sel]), ids_t[:, 1:][sel]
        digits = torch.tensor([int(t) in digit_ids for t in targets], device=model.device)
        # The mean probability of the right digit: what sampling at temperature 1 gets right.
        probs = torch.softmax(logits[digits], dim=-1)
        copy_acc = float(probs.gather(1, targets[digits][:, None]).mean())
        # The first trained position of each row is the decision: open a tool call or answer.
        first = mask_t[:, 1:].int().argmax(dim=1)
        rows = torch.arange(len(probe), device=model.device)
        p_first = torch.softmax(model.lm_head(hidden[rows, first]), dim=-1)[rows, ids_t[rows, first + 1]]
    model.train()
    return copy_acc, float(p_first.mean())


def warm_up(model: Any, chat: Any, train: list[dict[str, Any]], cfg: RunConfig,
            rng: random.Random, demo: Demo = demonstration) -> tuple[int, float, float]:
    """Supervised steps on mixed demonstrations until the copies are learned; returns (steps, copy accuracy, P(tool))."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr)
    probe, train = train[:16], train[16:]  # unseen problems: copying, not memorised answers
    model.train()
    step, settle, copy_acc = 0, 0, 0.0
    while step < cfg.warmup_steps and settle < cfg.warmup_settle_steps:
        step += 1
        demos = [demo(chat, rng.choice(train), rng.random() < cfg.warmup_tool_share, rng, cfg.guess_range)
                 for _ in range(cfg.warmup_batch)]
        logits, targets = _masked_logits(model, *_batch(chat, demos))
        loss = torch.nn.functional.cross_entropy(logits, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if settle:
            settle += 1
        elif step % 25 == 0:
            copy_acc, p_tool = warmup_probe(model, chat, probe, rng, demo)
            if step % 100 == 0:
                print(f"warm-up step {step}: P(right copied digit) {copy_acc:.2f}, P(tool call first) {p_tool:.2f}",
                      flush=True)
            if copy_acc >= cfg.warmup_copy_target:
                settle = 1
                for g in opt.param_groups:
                    g["lr"] = cfg.warmup_lr / 10
    copy_acc, p_tool = warmup_probe(model, chat, probe, rng, demo)
    model.eval()
    if copy_acc < cfg.warmup_copy_target:
        # Then a tool call cannot earn reward (the answer is not copied from the result): GRPO can raise the
        # tool use but hardly the reward, and the curve says nothing about learning.
        print(f"warning: the warm-up stopped at its cap of {cfg.warmup_steps} steps with copy accuracy "
              f"{copy_acc:.2f}, below the target {cfg.warmup_copy_target:.2f}: the policy does not copy the "
              "tool's result yet; raise --warmup-steps or take another seed", file=sys.stderr, flush=True)
    return step, copy_acc, p_tool


def warmup_cache_key(cfg: RunConfig) -> str:
    """The cache entry of a warm-up: the seed and every setting the warm-up's weights depend on."""
    import hashlib

    settings = {name: getattr(cfg, name) for name in (
        "seed", "n_eval", "warmup_tool_share", "guess_range", "warmup_steps", "warmup_copy_target",
        "warmup_settle_steps", "warmup_batch", "warmup_lr")}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return f"seed-{cfg.seed}-{digest}"


def warm_up_cached(model: Any, chat: Any, train: list[dict[str, Any]], cfg: RunConfig,
                   rng: random.Random, demo: Demo = demonstration) -> tuple[Any, int, float, float]:
    """:func:`warm_up`, or its checkpoint from ``cfg.warmup_cache``; returns (model, steps, copy accuracy, P(tool)).

    The weights are saved as float32 safetensors, so a loaded checkpoint is bit for bit the one the
    warm-up made. Nothing after the warm-up draws from ``rng``, so a run that loads it goes on as the
    run that saved it.
    """
    import torch
    from transformers import AutoModelForCausalLM

    entry = cfg.warmup_cache / warmup_cache_key(cfg) if cfg.warmup_cache is not None else None
    if entry is not None and (entry / "warmup.json").is_file():
        meta = json.loads((entry / "warmup.json").read_text())
        print(f"warm-up loaded from {entry} ({meta['steps']} steps)", flush=True)
        model = AutoModelForCausalLM.from_pretrained(str(entry), dtype=torch.float32).to(model.device)
        model.eval()
        return model, int(meta["steps"]), float(meta["copy_acc"]), float(meta["p_tool"])
    steps, copy_acc, p_tool = warm_up(model, chat, train, cfg, rng, demo)
    if entry is not None:
        model.save_pretrained(str(entry))
        chat.tokenizer.save_pretrained(str(entry))
        # Written last: an entry without it (a run killed while saving) is warmed up again.
        (entry / "warmup.json").write_text(json.dumps({"steps": steps, "copy_acc": copy_acc, "p_tool": p_tool}))
    return model, steps, copy_acc, p_tool


def grpo_update(model: Any, opt: Any, samples: list[Any], clip_eps: float) -> float:
    """One clipped policy-gradient step; ``sum(loss_weights * per-token loss)`` is the batch loss."""
    import torch

    model.train()
    opt.zero_grad()
    total = 0.0
    for s in samples:
        ids = torch.tensor([s.input_ids], device=model.device)
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        logp = logp.gather(1, ids[0, 1:, None])[:, 0]
        old = torch.tensor(s.old_log_probs[1:], device=model.device)
        w = torch.tensor(s.loss_weights[1:], device=model.device)
        ratio = torch.exp(logp - old)
        adv = s.advantage
        per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
        loss = (w * per_token).sum()
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    model.eval()
    return total


def flat_params(model: Any) -> Any:
    import torch

    return torch.cat([p.detach().reshape(-1).cpu().clone() for p in model.parameters()])


class Bridge:
    """The inference bridge of the stack: started once, then handed each new checkpoint in place."""

    def __init__(self, stack: Any) -> None:
        self.stack = stack
        self.name: str | None = None
        self.restarts = 0

    def serve(self, checkpoint: Path, version: int) -> str:
        from prorl_cli.exceptions import ReloadFailed

        if self.name is not None:
            try:
                self.stack.client.update_weights(checkpoint, policy_version=version)
                return "tiny"
            except ReloadFailed as e:  # an engine that cannot reload: the restart path
                print(f"reload failed ({e}); restarting the bridge on {checkpoint}", flush=True)
                self.stack.kill(self.name, signal.SIGTERM)  # unregisters; calls of cancelled jobs are already stopped
                self.restarts += 1
        backend_id = "tiny" if not self.restarts else f"tiny-r{self.restarts}"
        self.name = f"bridge-{self.restarts}"
        self.stack.spawn(self.name, "serve", "inference", "--engine", "transformers", "--model", str(checkpoint),
                         "--backend-id", backend_id, "--capacity", "4")
        self.stack.wait_for(lambda st: any(b.backend_id == backend_id and b.alive for b in st.backends),
                            180, f"bridge {backend_id}", self.name)
        return backend_id


def used_tool(result: Any) -> bool:
    """Whether the episode called the calculator (a tool message in its trajectory)."""
    messages = (result.output or {}).get("trajectory", {}).get("messages", [])
    return any(m.get("role") == "tool" for m in messages)


def evaluate(client: Any, held_out: list[dict[str, Any]], cfg: RunConfig, tag: str) -> tuple[float, float]:
    """(mean reward, share of episodes that called the calculator) on the held-out problems.

    Sampling seeds are fixed per (problem, sample), the same at every evaluation.
    """
    from prorl_cli.protocol import JobSpec, SamplingParams

    specs, instances = [], []
    for i, problem in enumerate(held_out):
        for k in range(cfg.eval_samples):
            sampling = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=1000 * i + k)
            specs.append(JobSpec(job_id=f"eval-{cfg.seed}-{tag}-{i}-{k}", task=TASK, timeout_s=300, sampling=sampling))
            instances.append(problem)
    client.submit_specs(specs, instances)
    results = client.wait([s.job_id for s in specs], timeout_s=900)
    return (sum(float(r.reward or 0.0) for r in results) / len(results),
            sum(used_tool(r) for r in results) / len(results))


def run(cfg: RunConfig) -> RunSummary:
    import torch
    from transformers import AutoModelForCausalLM

    from prorl_cli.agent import ChatTokens
    from prorl_cli.embedded import LocalStack
    from prorl_cli.handlers.math_agent import CALCULATOR_SCHEMA
    from prorl_cli.inference.device import resolve_device
    from prorl_cli.inference.tiny_model import make_tiny_model
    from prorl_cli.training.export import write_samples_jsonl, write_samples_parquet
    from prorl_cli.training.sampler import BlockingDapoSampler, SamplerConfig
    from prorl_cli.training.samples import samples_from_results

    started = time.monotonic()
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)  # the node and the bridge need the other core
    cfg.out.mkdir(parents=True, exist_ok=True)
    init_dir = make_tiny_model(cfg.out / "model-init", seed=cfg.seed)
    chat = ChatTokens.from_pretrained(init_dir, tools=[CALCULATOR_SCHEMA])
    device = resolve_device(cfg.device)
    model: Any = AutoModelForCausalLM.from_pretrained(str(init_dir), dtype=torch.float32)
    model = model.to(device)
    print(f"training on {device}", flush=True)
    every = problems(rng)
    held_out, train = every[:cfg.n_eval], every[cfg.n_eval:]
    tok_dir = str(init_dir)
    for p in train + held_out:
        p["tokenizer"] = tok_dir
        p["max_turns"] = 3

    summary = RunSummary(seed=cfg.seed)
    if cfg.init_from is not None:
        model = AutoModelForCausalLM.from_pretrained(str(cfg.init_from), dtype=torch.float32)
        model = model.to(device)
        print(f"warm-up skipped: weights from {cfg.init_from}", flush=True)
    else:
        model, summary.warmup_steps, summary.warmup_copy_acc, summary.warmup_p_tool = warm_up_cached(
            model, chat, train, cfg, rng)
        print(f"warm-up: {summary.warmup_steps} supervised steps, copy accuracy {summary.warmup_copy_acc:.2f}, "
              f"P(tool call first) {summary.warmup_p_tool:.2f} ({time.monotonic() - started:.0f} s)", flush=True)

    def checkpoint(version: int) -> Path:
        path = cfg.out / "checkpoints" / f"v{version}"
        model.save_pretrained(str(path))
        chat.tokenizer.save_pretrained(str(path))
        return path

    version = 0
    with LocalStack(cfg.out / "stack", f"grpo{cfg.seed}", {"log_level": "WARNING", "node": {"n_init": 4, "n_run": 8, "n_eval": 4}}) as stack:
        stack.start_broker()
        stack.start_node("node")
        bridge = Bridge(stack)
        bridge.serve(checkpoint(version), version)
        client = stack.client
        reward, tools = evaluate(client, held_out, cfg, "v0")
        summary.curve.append((0, reward))
        summary.tool_use.append((0, tools))
        print(f"step 0: held-out reward {reward:.3f}, tool use {tools:.2f} ({time.monotonic() - started:.0f} s)", flush=True)
        sampler = BlockingDapoSampler(client, TASK, train, SamplerConfig(
            group_size=cfg.group_size, target_groups=cfg.target_groups, run_id=f"grpo{cfg.seed}",
            max_in_flight=2 * cfg.group_size,  # one engine serves one call at a time: a short queue wastes less at cancel
            carry_over=False, sampling={"max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "seed": cfg.seed},
            max_staleness=1,  # surplus groups at most one update old: the setting the recorded curves ran with
            timeout_s=300, step_timeout_s=1800,
        ))
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        samples: list[Any] = []
        for step in range(1, cfg.steps + 1):
            batch = sampler.step(policy_version=version)
            built = samples_from_results(batch.results, group_of=batch.group_of)
            samples = built.samples
            calls = [c for r in batch.results for c in r.output["trajectory"]["calls"]]
            summary.policy_versions_seen.append(sorted({c.get("policy_version") for c in calls if c.get("policy_version") is not None}))
            summary.backends_seen.append(sorted({str(c.get("backend_id")) for c in calls}))
            before = flat_params(model)
            # A few clipped epochs over the batch (PPO style): the old log-probs are the engine's, from sampling time.
            losses = [grpo_update(model, opt, samples, cfg.clip_eps) for _ in range(cfg.ppo_epochs)]
            loss = losses[0]
            summary.weight_deltas.append(float((flat_params(model) - before).norm()))
            summary.losses.append(loss)
            summary.train_rewards.append(sum(r.reward or 0.0 for r in batch.results) / max(1, len(batch.results)))
            summary.merge_ratio.append(built.report.merge_ratio)
            summary.filtered.append(batch.stats.filtered)
            # Weight sync: hold generate calls (none in flight), load the new checkpoint in place, resume under the new version.
            version += 1
            with client.generation_paused(version, drain_timeout_s=120):
                bridge.serve(checkpoint(version), version)
            train_tools = sum(used_tool(r) for r in batch.results) / max(1, len(batch.results))
            line = (f"step {step}: loss {loss:+.4f}, train reward {summary.train_rewards[-1]:.3f}, "
                    f"train tool use {train_tools:.2f}, "
                    f"filtered {batch.stats.filtered}, merge ratio {built.report.merge_ratio:.2f}, |dW| {summary.weight_deltas[-1]:.4f}")
            if step % cfg.eval_every == 0 or step == cfg.steps:
                reward, tools = evaluate(client, held_out, cfg, f"v{version}")
                summary.curve.append((step, reward))
                summary.tool_use.append((step, tools))
                line += f", held-out reward {reward:.3f}, tool use {tools:.2f}"
            print(line + f" ({time.monotonic() - started:.0f} s)", flush=True)
        sampler.close()
    write_samples_jsonl(cfg.out / "samples.jsonl", samples)
    write_samples_parquet(cfg.out / "samples.parquet", samples)
    summary.wall_s = time.monotonic() - started
    (cfg.out / "summary.json").write_text(json.dumps(asdict(summary), indent=1))
    (cfg.out / "curve.json").write_text(json.dumps(summary.curve))
    reward_plots.plot_run(cfg.out / "reward_curve.png", summary.curve, summary.train_rewards, summary.tool_use)
    print("reward curve (step, held-out mean reward): " + ", ".join(f"({s}, {r:.3f})" for s, r in summary.curve))
    return summary


def aggregate(runs: list[RunSummary], path: Path) -> list[tuple[int, float, float, float]]:
    """Per evaluation point: (step, mean, min, max) of the held-out reward over the runs; plots them to ``path``."""
    points = reward_plots.spread([r.curve for r in runs])
    print("held-out reward over seeds " + ", ".join(str(r.seed) for r in runs) + " (step: mean [min, max]): "
          + ", ".join(f"{s}: {m:.3f} [{lo:.3f}, {hi:.3f}]" for s, m, lo, hi in points), flush=True)
    reward_plots.plot_seeds(path, {r.seed: r.curve for r in runs}, points)
    return points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--warmup-steps", type=int)
    ap.add_argument("--lr", type=float, help="GRPO learning rate (default 2e-4)")
    ap.add_argument("--ppo-epochs", type=int, help="clipped epochs over each step's batch (default 1)")
    ap.add_argument("--temperature", type=float, help="sampling temperature, training and held-out (default 0.7)")
    ap.add_argument("--init-from", type=Path, help="skip the warm-up: start from this model directory")
    ap.add_argument("--warmup-cache", type=Path,
                    help="keep the warm-up checkpoint here per seed and warm-up settings, and load it when there "
                         "(shared with examples/train_trl_grpo.py)")
    ap.add_argument("--short", action="store_true", help="the CI configuration: 2 GRPO steps, a small eval")
    ap.add_argument("--device", default="auto",
                    help="where the policy trains: auto (the GPU when torch sees one, else the CPU), cpu, cuda:N")
    ap.add_argument("--seeds", type=int, default=1,
                    help="run seeds SEED..SEED+N-1 one after another (OUT/seed-K each), then print the mean "
                         "and spread per evaluation point and plot them to OUT/reward_curve_seeds.png")
    ap.add_argument("--plot-only", action="store_true",
                    help="with --seeds: only aggregate OUT/seed-K that runs (e.g. started in parallel) wrote")
    args = ap.parse_args(argv)
    if args.seeds > 1:
        runs = []
        for seed in range(args.seed, args.seed + args.seeds):
            if args.plot_only:
                runs.append(RunSummary(**json.loads((args.out / f"seed-{seed}" / "summary.json").read_text())))
                continue
            sub = [a for a in (argv if argv is not None else sys.argv[1:])]
            sub = _replace_arg(_replace_arg(sub, "--out", str(args.out / f"seed-{seed}")), "--seed", str(seed))
            sub = _replace_arg(sub, "--seeds", "1")
            if main(sub) != 0:
                return 1
            runs.append(RunSummary(**{**json.loads((args.out / f"seed-{seed}" / "summary.json").read_text())}))
        aggregate(runs, args.out / "reward_curve_seeds.png")
        return 0
    cfg = RunConfig(out=args.out, seed=args.seed, device=args.device)
    if args.short:
        # A capped warm-up: the copies are not learned yet, so one-digit guesses (right one time in
        # nine) give the groups their reward variance; this checks the plumbing, not learning.
        cfg.guess_range = (1, 9)
        cfg.steps, cfg.warmup_steps, cfg.n_eval, cfg.eval_samples, cfg.eval_every = 2, 120, 4, 1, 2
        cfg.target_groups, cfg.group_size = 2, 4
    for name in ("steps", "warmup_steps", "lr", "ppo_epochs", "temperature"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    cfg.init_from, cfg.warmup_cache = args.init_from, args.warmup_cache
    from prorl_cli.exceptions import SamplerError

    try:
        summary = run(cfg)
    except SamplerError as e:  # a step the sampler stopped: the message says why and which setting; no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if all(math.isfinite(x) for x in summary.losses) else 1


def _replace_arg(argv: list[str], flag: str, value: str) -> list[str]:
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == flag:
            skip = i + 1 < len(argv)
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out + [flag, value]


if __name__ == "__main__":
    raise SystemExit(main())
