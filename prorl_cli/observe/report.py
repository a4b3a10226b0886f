"""``prorl report --html``: one self-contained static HTML page about a run.

Plots made with matplotlib and embedded as base64 PNG (throughput over time,
stage-time split per handler, reward histogram per handler, turns per
rollout), a failure table, a table of every job linking to its trajectory
view (calls, outputs, observations, violations, failure). No script, no
external file: the page opens anywhere, offline.
"""

from __future__ import annotations

import base64
import html
import io
import time
from collections import Counter, defaultdict
from typing import Any

from prorl_cli.observe.inspect import (
    call_views,
    conversation_count,
    conversation_label,
    requeues,
    trajectory_of,
    violations,
)
from prorl_cli.observe.trace import _submitted_at
from prorl_cli.protocol import STAGE_NAMES, JobResult

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1400px}
h1{margin-bottom:0}.sub{color:#666;margin-top:.2em}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:1em}
.plots figure{margin:0;border:1px solid #ddd;padding:.5em}.plots img{width:100%}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f4f4f4}.bad{color:#b00}.ok{color:#070}pre{white-space:pre-wrap;background:#f8f8f8;padding:.5em;margin:.2em 0}
.job{border-top:2px solid #999;margin-top:2em}.viol{background:#fee;border:1px solid #b00;padding:.4em}
.obs{background:#eef4ff}
"""


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _plots(results: list[JobResult]) -> list[tuple[str, str]]:
    """(title, base64 PNG) of each plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r.task for r in results})
    out: list[tuple[str, str]] = []
    ats = [a for a in map(_submitted_at, results) if a is not None]
    base = min(ats) if ats else None

    # Throughput: finished jobs over time, per handler.
    fig, ax = plt.subplots(figsize=(7, 3.6))
    plotted = False
    for task in tasks:
        ends = []
        for r in results:
            at = _submitted_at(r)
            if r.task == task and at is not None and base is not None and r.events:
                ends.append(at - base + max(ev[1] + ev[2] for ev in r.events))
        if ends:
            ends.sort()
            ax.step(ends, range(1, len(ends) + 1), where="post", label=_task_label(task))
            plotted = True
    ax.set_xlabel("seconds since the first submission")
    ax.set_ylabel("jobs finished")
    if plotted:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no timelines in these results", ha="center", transform=ax.transAxes)
    out.append(("Throughput over time", _png(fig)))
    plt.close(fig)

    # Stage-time split per handler: mean queue, waits and in-stage time.
    parts = list(STAGE_SPLIT_PARTS)
    means = stage_split(results)
    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.6 * max(1, len(tasks))))
    left = [0.0] * len(tasks)
    for p in parts:
        widths = [means[t][p] for t in tasks]
        if any(widths):
            ax.barh([_task_label(t) for t in tasks], widths, left=left, label=p)
            left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("mean seconds per job")
    if any(left):
        ax.legend(fontsize="small", ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    else:  # an empty plot would not say why: results without stage times or timelines (jobs that never ran)
        ax.text(0.5, 0.5, "no stage times or timelines in these results", ha="center", transform=ax.transAxes)
    out.append(("Where the time goes: stage split per handler", _png(fig)))
    plt.close(fig)

    # Reward histogram per handler.
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(3.2 * max(1, len(tasks)) + 1, 3), squeeze=False)
    for ax, task in zip(axes[0], tasks or ["-"], strict=False):
        rewards = [r.reward for r in results if r.task == task and r.reward is not None]
        ax.hist(rewards, bins=min(20, max(1, len(set(rewards)))) if rewards else 1, color="#4477aa")
        ax.set_title(f"{_task_label(task)}: reward ({len(rewards)} jobs)", fontsize="small")
    out.append(("Reward histogram per handler", _png(fig)))
    plt.close(fig)

    # Turns (model calls) per rollout.
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for task in tasks:
        turns = [_turns(r) for r in results if r.task == task]
        counts = Counter(turns)
        xs = sorted(counts)
        ax.plot(xs, [counts[x] for x in xs], marker="o", label=_task_label(task))
    ax.set_xlabel("model calls in the rollout")
    ax.set_ylabel("rollouts")
    if tasks:
        ax.legend()
    out.append(("Turns per rollout", _png(fig)))
    plt.close(fig)
    return out


def _task_label(task: str) -> str:
    """A handler's name as a plot shows it: a result that names none (a trajectories file without ``task``) would
    get an empty label, which matplotlib leaves out of a legend (with a warning on stderr)."""
    return task or "(no task)"


#: The parts of the stage-split plot, in stacking order.
STAGE_SPLIT_PARTS = ("queue", *(f"wait {s}" for s in STAGE_NAMES), *STAGE_NAMES)


def stage_split(results: list[JobResult]) -> dict[str, dict[str, float]]:
    """Per task, the mean seconds per job of each part of :data:`STAGE_SPLIT_PARTS`.

    ``queue`` is the broker's queue time: from acceptance (or from each re-queue, when a job's node
    was lost) to its next assignment; the time a job spent on a lost node is not queue time.
    """
    means: dict[str, dict[str, float]] = {}
    for task in sorted({r.task for r in results}):
        rs = [r for r in results if r.task == task]
        sums: dict[str, float] = defaultdict(float)
        for r in rs:
            for s, v in r.stage_s.items():
                sums[s] += v
            queued_from: float | None = 0.0
            for ev in r.events or []:
                attrs = ev[3] if len(ev) > 3 and isinstance(ev[3], dict) else {}
                if ev[0] == "wait":
                    sums[f"wait {attrs.get('stage')}"] += ev[2]
                elif ev[0] == "requeued":
                    queued_from = ev[1]
                elif ev[0] == "assigned" and queued_from is not None:
                    sums["queue"] += max(0.0, ev[1] - queued_from)
                    queued_from = None
        means[task] = {p: sums[p] / len(rs) for p in STAGE_SPLIT_PARTS}
    return means


def _turns(r: JobResult) -> int:
    """Model calls of a rollout: its trajectory's calls, else the generate calls on its timeline."""
    traj = trajectory_of(r)
    if traj is not None:
        return len(traj.get("calls") or [])
    return sum(1 for ev in r.events or [] if ev and ev[0] == "generate")


def _failures(results: list[JobResult]) -> list[tuple[str, str, str, int, str]]:
    groups: dict[tuple[str, str, str], list[Any]] = {}
    for r in results:
        if r.state == "done":
            continue
        err = r.error or {}
        key = (r.task, str(err.get("stage") or r.state), str(err.get("type") or r.state))
        g = groups.setdefault(key, [0, ""])
        g[0] += 1
        g[1] = str(err.get("message") or "")
    return sorted(((*k, g[0], g[1]) for k, g in groups.items()), key=lambda x: -x[3])


def _job_section(r: JobResult) -> str:
    e = html.escape
    out = [f'<section class="job" id="job-{e(r.job_id)}"><h3>{e(r.job_id)}</h3>',
           f"<p>task {e(r.task)} · state <span class='{'ok' if r.state == 'done' else 'bad'}'>{e(r.state)}</span> · "
           f"reward {r.reward if r.reward is not None else '-'} · attempt {r.attempt} · node {e(r.node_id or '-')} · "
           + " · ".join(f"{e(k)} {v:.3f}s" for k, v in r.stage_s.items()) + "</p>"]
    if r.error:
        out.append(f"<p class='bad'>failed in {e(str(r.error.get('stage')))}: {e(str(r.error.get('type')))}: "
                   f"{e(str(r.error.get('message')))}</p>")
    for line in requeues(r):
        out.append(f"<p class='bad'>{e(line)}</p>")
    for v in violations(r):
        out.append(f"<p class='viol'>continuity violation at call {v.get('call')}: {e(str(v.get('message')))}</p>")
    traj = trajectory_of(r)
    if traj is None:
        out.append("<p>(no token-level trajectory)</p></section>")
        return "".join(out)
    views = call_views(traj)
    several = conversation_count(views) > 1
    for c in views:
        lp = f"logprob mean {c.logprob_mean:.3f}, min {c.logprob_min:.3f}" if c.logprob_mean is not None else "no logprobs"
        label = conversation_label(c, several)
        out.append(f"<h4>call {c.index}{f' · {e(label)}' if label else ''}"
                   f"{'' if c.prefix_ok else ' <span class=bad>(continuity broken)</span>'}</h4>"
                   f"<p>backend {e(str(c.backend))} · finish {e(c.finish)} · prompt {c.prompt_len} ids "
                   f"(+{len(c.new_prompt_ids)} new) · output {len(c.output_ids)} ids · {lp}"
                   f"{''.join(f' · {e(n)}' for n in c.sampling_notes)}</p>"
                   f"<pre>{e(c.text)}</pre>")
        for obs in c.observations:
            out.append(f"<pre class='obs'>{e(str(obs.get('role')))}: {e(str(obs.get('content')))}</pre>")
    out.append("</section>")
    return "".join(out)


def render_html(results: list[JobResult], title: str, max_trajectories: int = 500) -> str:
    """The whole report page."""
    e = html.escape
    by_state = Counter(r.state for r in results)
    rewards = [r.reward for r in results if r.reward is not None]
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{e(title)}</title>"
             f"<style>{_CSS}</style></head><body>",
             f"<h1>{e(title)}</h1><p class='sub'>{len(results)} job(s): "
             + ", ".join(f"{e(k)} {v}" for k, v in sorted(by_state.items()))
             + (f" · mean reward {sum(rewards) / len(rewards):.3f}" if rewards else "")
             + f" · made {time.strftime('%Y-%m-%d %H:%M:%S')} by prorl report</p>",
             "<h2>Plots</h2><div class='plots'>"]
    for plot_title, png in _plots(results):
        parts.append(f"<figure><figcaption>{e(plot_title)}</figcaption>"
                     f"<img alt='{e(plot_title)}' src='data:image/png;base64,{png}'></figure>")
    parts.append("</div><h2>Failures</h2>")
    fails = _failures(results)
    if fails:
        parts.append("<table><tr><th>task</th><th>stage</th><th>error</th><th>jobs</th><th>sample message</th></tr>")
        for task, stage, typ, n, msg in fails:
            parts.append(f"<tr><td>{e(task)}</td><td>{e(stage)}</td><td>{e(typ)}</td><td>{n}</td><td>{e(msg)}</td></tr>")
        parts.append("</table>")
    else:
        parts.append("<p>none</p>")
    parts.append("<h2>Jobs</h2><table><tr><th>job</th><th>task</th><th>state</th><th>reward</th><th>calls</th>"
                 "<th>in-stage s</th><th>violations</th></tr>")
    shown = results[:max_trajectories]
    for i, r in enumerate(results):
        # By position: ``r in shown`` compared every result with every shown one (minutes for a large run).
        link = f"<a href='#job-{e(r.job_id)}'>{e(r.job_id)}</a>" if i < len(shown) else e(r.job_id)
        n_calls = _turns(r)
        parts.append(f"<tr><td>{link}</td><td>{e(r.task)}</td><td class='{'ok' if r.state == 'done' else 'bad'}'>"
                     f"{e(r.state)}</td><td>{r.reward if r.reward is not None else '-'}</td><td>{n_calls}</td>"
                     f"<td>{r.active_s:.3f}</td><td>{len(violations(r))}</td></tr>")
    parts.append("</table><h2>Trajectories</h2>")
    if len(results) > len(shown):
        parts.append(f"<p>the first {len(shown)} of {len(results)} (--max-trajectories)</p>")
    parts.extend(_job_section(r) for r in shown)
    parts.append("</body></html>")
    return "".join(parts)
