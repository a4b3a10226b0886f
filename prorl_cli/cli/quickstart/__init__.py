"""``prorl quickstart``: the whole stack embedded on this machine, one command.

It starts a broker, one node server (and, with a model, an inference bridge)
as child processes, submits a small task set, writes the trajectories and a
summary, and stops everything it started.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.quickstart.domains import DOMAIN_TASKS, QUICK_SETTINGS, DomainPlan, plan_domain
from prorl_cli.exceptions import StartTimeout

#: The output folder's lock file: one quickstart at a time per folder.
QUICKSTART_LOCK = "quickstart.lock"

if TYPE_CHECKING:
    from prorl_cli.embedded import LocalStack

NO_LLM_TASKS: list[Any] = [
    {"echo": f"instance {i}", "sleep_s": {"init": 0.02, "run": 0.05, "eval": 0.02}} for i in range(16)
] + [{"echo": "fails in run", "raise_in": "run"}, {"echo": "hangs in eval", "hang_in": "eval"}]


@click.command()
@click.option("--out", "qs_out", type=click.Path(file_okay=False, path_type=Path), default=Path("prorl-quickstart"),
              show_default=True, help="Folder for the run: trajectories, summary, logs and the embedded deployment's files.")
# The old name of --out; hidden, since `prorl --home` is PRORL_HOME everywhere else.
@click.option("--home", "qs_home", type=click.Path(file_okay=False, path_type=Path), hidden=True)
@click.option("--engine", type=click.Choice(["auto", "none", "transformers", "vllm", "sim"]), default="auto", show_default=True,
              help="Model engine for the agent; 'none' runs the scripted test handler (no LLM); 'sim' a simulated GPU "
                   "server with the SWE-like sim_agent (no model, no torch); 'auto' picks transformers when torch is installed.")
@click.option("--model", type=click.Path(file_okay=False, path_type=Path),
              help="Local HF model directory (default: a tiny random model made with 'prorl dev tiny-model').")
@click.option("-n", "--n", "n", type=click.IntRange(min=1), default=2, show_default=True, help="Rollouts per instance.")
@click.option("--task", "domain", type=click.Choice(DOMAIN_TASKS),
              help="Run a task domain (docs/domains.md) instead of the default calculator agent: "
                   "its shipped dataset, its sandbox image (built on first use) and its scorer. Needs a model "
                   "engine: transformers (torch) or vllm, not none or sim.")
@click.option("--image", metavar="IMAGE",
              help="With --task: the sandbox image instead of building the domain's: a .sif or sandbox folder, or an "
                   "image name (a `prorl build-images` build, or one in images.search_dirs).")
@click.option("--instances", "n_instances", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --task: how many instances of the shipped dataset to run.")
@pass_app
def quickstart(app: App, qs_out: Path, qs_home: Path | None, engine: str, model: Path | None, n: int, domain: str | None,
               image: str | None, n_instances: int) -> None:
    """Run broker, node (and inference) on this machine, roll out a task set, write trajectories."""
    if qs_home is not None:
        app.err_console.print("[yellow]warning:[/] quickstart --home is now --out (prorl --home is PRORL_HOME)")
        qs_out = qs_home
    home = qs_out.resolve()
    _check_ignored_options(app, click.get_current_context(), domain, engine, model, image)
    if domain is not None and engine in ("auto", "none", "sim"):
        _check_domain_engine(app, domain, engine)
    if engine == "auto":
        engine = "transformers" if _has_torch() else "none"
    if model is not None and engine not in ("none", "sim") and not (model / "config.json").is_file():
        # Said before anything starts: a broker and a node would otherwise come up first.
        app.abort(f"--model {model}: no config.json; give a local Hugging Face model directory")
    try:
        _hold_folder(app, home)  # held until this process ends
    except PermissionError as e:
        app.abort(f"{home}: {e.strerror or e}: run quickstart from a folder you can write, or give --out DIR")
    plan = plan_domain(app, domain, home, image, n_instances) if domain else None
    model_dir = (model or home / "tiny-model").resolve()
    config: dict[str, Any] = {
        # One self-contained run: nothing to replay if an earlier quickstart was killed.
        "broker": {"heartbeat_interval_s": 0.5, "journal": False},
        "node": {"n_init": 4, "n_run": 8, "n_eval": 4},
        "jobs": {"timeout_s": 300.0 if engine != "none" else 2.0},
    }
    if engine not in ("none", "sim"):
        config["inference"] = {"tokenizer": str(model_dir)}
        if model is None and plan is None:
            # The tiny model's weights are random: its turns never call the calculator nor end early, so the
            # handler's own 4 turns of 256 tokens would only make the first run minutes slower on a CPU.
            config["handlers"] = {"math_agent": dict(QUICK_SETTINGS)}
    else:
        # The no-model modes run the test handlers, which production nodes do not serve.
        config["node"]["handler_paths"] = ["prorl_cli.testing.handlers"]
    if plan is not None:
        for section, values in plan.config.items():
            config[section] = {**config.get(section, {}), **values}
    out = home / "trajectories.jsonl"
    summary_path = home / "summary.json"
    # An earlier run's results go first, so the folder never mixes two runs (a model run's Parquet beside a
    # later scripted run's JSONL).
    earlier = [p for p in (out, home / "trajectories.parquet", summary_path) if p.exists()]
    if earlier:
        app.console.print(f"replacing an earlier run's results in {home}: {', '.join(p.name for p in earlier)}")
        for p in earlier:
            p.unlink()
    try:
        _run(app, home, config, engine, model, model_dir, n, plan, out, summary_path)
    except StartTimeout as e:  # LocalStack.wait_for: a child died or never registered; the message ends with its log
        what, _, log_tail = str(e).partition("\n")
        app.abort(f"quickstart {what}: {_last_line(log_tail)} (every log in {home / 'logs'})")
    app.console.print(f"summary in {summary_path}; deployment stopped")


def _check_ignored_options(app: App, ctx: click.Context, domain: str | None, engine: str, model: Path | None,
                           image: str | None) -> None:
    """Refuse an option this run would not use, before anything starts, saying what to change.

    The rule: every option a user gives changes the run or is refused. ``--image`` and ``--instances`` belong to
    ``--task`` runs (the default calculator agent has no sandbox and a fixed task set), and ``--model`` to the
    engines that serve one (``none`` and ``sim`` run no model); taken silently, they would leave the user
    believing the run used them.
    """
    if domain is None:
        given = [flag for flag, name, value in (("--image", "image", image), ("--instances", "n_instances", None))
                 if value is not None or ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
        if given:
            flags = " and ".join(given)
            others = ", ".join(DOMAIN_TASKS[1:])
            app.abort(f"{flags} {'applies' if len(given) == 1 else 'apply'} to a task domain run only: add "
                      f"--task {DOMAIN_TASKS[0]} (or {others}; docs/domains.md), or drop {flags} for the calculator "
                      "agent")
    if model is not None and engine in ("none", "sim"):
        app.abort(f"--engine {engine} runs no model, so --model {model} would not be used: drop --model, or give "
                  "--engine transformers or vllm to serve it")


def _check_domain_engine(app: App, domain: str, engine: str) -> None:
    """Refuse ``--task DOMAIN`` with an engine that has no model, saying why: ``--engine none|sim`` chosen (its
    scripted handler cannot run a domain: drop the flag), or torch missing (``auto`` finds no engine to run)."""
    if engine == "auto":
        if _has_torch():
            return
        app.abort(f"--task {domain} needs a model, and torch is not installed here (--engine auto picks "
                  "transformers only with it): install the cpu extra (pip install 'prorl[cpu]'), or the vllm extra "
                  "and give --engine vllm")
    runs = "the scripted 'test' handler" if engine == "none" else "the SWE-like 'sim_agent' on a simulated server"
    instead = ("drop --engine (auto picks transformers: torch is installed) or give --engine transformers or vllm"
               if _has_torch() else "give --engine transformers with the cpu extra (torch) installed, or --engine "
               "vllm with the vllm extra")
    app.abort(f"--engine {engine} runs {runs}, without a model, and cannot run --task {domain}, whose agent needs "
              f"one: {instead}; or drop --task {domain} for the {'scripted' if engine == 'none' else 'simulated'} run")


def _hold_folder(app: App, home: Path) -> int:
    """An exclusive lock on the output folder for this quickstart's life (the kernel drops it when the process
    ends, even by SIGKILL). A second quickstart in the same folder is refused at once, naming the folder; it
    would otherwise start a broker the first one's refuses and write over the same results."""
    import fcntl
    import os

    home.mkdir(parents=True, exist_ok=True)
    path = home / QUICKSTART_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        app.abort(f"another quickstart is running in {home} (pid {holder}): wait for it to end, or give this one "
                  "another --out")
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _run(app: App, home: Path, config: dict[str, Any], engine: str, model: Path | None, model_dir: Path, n: int,
         plan: DomainPlan | None, out: Path, summary_path: Path) -> None:
    """Start the stack, run the task set, write the summary, stop the stack (whatever happens, in the end)."""
    from prorl_cli.cli.jobs import run_submission
    from prorl_cli.embedded import LocalStack

    con = app.console
    with LocalStack(home, "quickstart", config) as stack:
        con.print(f"[bold]prorl quickstart[/] in {home} (logs in {stack.logs})")
        stack.start_broker()
        con.print(f"  broker up at {stack.address}")
        stack.start_node("node-0")
        con.print("  node-0 registered")
        if engine == "none":
            advice = ("--engine transformers runs a real agent on a tiny model" if _has_torch() else
                      "install the cpu extra (torch) for a real agent on a tiny model")
            con.print(f"  [yellow]no LLM:[/] running the scripted 'test' handler (sleeps, one failure, one timeout); "
                      f"{advice}")
            task, instances = "test", list(NO_LLM_TASKS)
        elif engine == "sim":
            task, instances = _start_sim_inference(app, stack)
        else:
            task, instances = _start_inference(app, stack, engine, model_dir, made_here=model is None)
        if plan is not None:
            task, instances = plan.task, plan.instances
            con.print(f"  task [bold]{task}[/]: {len(instances)} instance(s) x {n}; sandbox runtime "
                      f"[bold]{plan.runtime}[/], image {plan.image or '(none)'}")
            for note in plan.notes:
                con.print(f"  [yellow]note:[/] {note}")
        started = time.monotonic()
        # Ctrl-C ends the quickstart's own deployment too: nothing is left to collect later.
        results = run_submission(app, stack.client, task, instances, n, out, None, None, cancel_hint="")
        elapsed_s = time.monotonic() - started
        summary: dict[str, Any] = {
            "engine": engine,
            "task": task,
            "runtime": plan.runtime if plan else None,
            "image": plan.image if plan else None,
            "jobs": len(results),
            "states": {s: sum(r.state == s for r in results) for s in sorted({r.state for r in results})},
            "mean_reward": _mean([r.reward for r in results if r.reward is not None]),
            "elapsed_s": elapsed_s,
            "trajectories": str(out),
        }
        if engine == "sim":
            summary["backends"] = {b.backend_id: b.stats for b in stack.client.status().backends}
        if plan is not None and model is None:
            summary["note"] = "the tiny model has random weights: rewards near 0 are expected; pass --model DIR"
        if (task == "math_agent" or plan is not None) and _has_pyarrow() and any(
            r.state == "done" and isinstance(r.output, dict) and "trajectory" in r.output for r in results
        ):
            from prorl_cli.cli.jobs.collect import write_trajectories_parquet

            parquet = home / "trajectories.parquet"
            summary["parquet_rows"] = write_trajectories_parquet(app, results, parquet)
            summary["parquet"] = str(parquet)
        summary_path.write_text(json.dumps(summary, indent=2))
        stack.stop()


def _last_line(log: str) -> str:
    """The last line a child logged (its error, when it died of one), for the one error line; its log has the rest."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    return f"its log ends {lines[-1]!r}" if lines else "its log is empty"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _has_pyarrow() -> bool:
    import importlib.util

    return importlib.util.find_spec("pyarrow") is not None


def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


MATH_TASKS = [
    {"question": "What is 17 * 23?", "answer": "391"},
    {"question": "What is 1234 + 4321?", "answer": "5555"},
    {"question": "What is 2 ** 10?", "answer": "1024"},
    {"question": "What is 144 / 12?", "answer": "12"},
    {"question": "What is 99 - 57?", "answer": "42"},
    {"question": "What is (3 + 4) * 5?", "answer": "35"},
    {"question": "What is 81 // 4?", "answer": "20"},
    {"question": "What is 7 * 8 * 9?", "answer": "504"},
]


#: Short SWE-like rollouts on a simulated H100 run 20x faster than real time.
SIM_SPEEDUP = 20.0
SIM_TASKS = [
    {"seed": i, "turns": [3, 8], "prompt_tokens": 1500, "observation_tokens": {"median": 300, "max": 3000},
     "tool_s": {"median": 0.5, "max": 10.0}, "time_scale": SIM_SPEEDUP, "p_solve": 0.5}
    for i in range(8)
]


def _start_sim_inference(app: App, stack: LocalStack) -> tuple[str, list[Any]]:
    """Start a bridge with the simulated engine and wait until it registers."""
    stack.spawn("inference-0", "serve", "inference", "--engine", "sim", "--sim-speedup", str(SIM_SPEEDUP),
                "--backend-id", "inference-0")
    stack.wait_for(
        lambda st: any(b.backend_id == "inference-0" and b.alive for b in st.backends),
        60.0, "the sim inference bridge to register", "inference-0",
    )
    app.console.print(f"  inference-0 registered (simulated H100, 8B model, {SIM_SPEEDUP:g}x real time; "
                      "the sim_agent's rewards are coin flips)")
    return "sim_agent", list(SIM_TASKS)


def _start_inference(app: App, stack: LocalStack, engine: str, model_dir: Path, made_here: bool) -> tuple[str, list[Any]]:
    """Make the tiny model if needed, start an inference bridge, wait until it registers."""
    con = app.console
    if not (model_dir / "config.json").exists():
        if not made_here:
            app.abort(f"--model {model_dir}: no config.json; give a local Hugging Face model directory")
        con.print(f"  making a tiny random Qwen2 model in {model_dir} (offline, seconds)")
        proc = stack.spawn("tiny-model", "dev", "tiny-model", str(model_dir))
        if proc.wait() != 0:
            app.abort(f"prorl dev tiny-model failed: {_last_line(stack.log('tiny-model'))} "
                      f"(log: {stack.logs / 'tiny-model.log'})")
    stack.spawn("inference-0", "serve", "inference", "--engine", engine, "--model", str(model_dir), "--backend-id", "inference-0")
    stack.wait_for(
        lambda st: any(b.backend_id == "inference-0" and b.alive for b in st.backends),
        900.0, f"the {engine} inference bridge to register", "inference-0",
    )
    con.print(f"  inference-0 registered ({engine} engine, model {model_dir})")
    if made_here:
        con.print("  [yellow]the tiny model has random weights:[/] expect rewards near 0; short loops "
                  f"({QUICK_SETTINGS['max_turns']} turns of {QUICK_SETTINGS['max_tokens']} tokens); "
                  "pass --model DIR for a real model")
    return "math_agent", list(MATH_TASKS)
