"""The live dashboard (``prorl top``, ``prorl status --watch``): a deployment at a glance, refreshed each second.

A :class:`Dashboard` turns successive status reports into a :class:`Snapshot`
(the report plus rates over the last interval) and renders it with rich:
jobs by task and state, throughput (jobs/s, tokens/s in and out), each
node's stage pools against their limits, each backend's load, and the
failures grouped by task, stage and error type with a sample message.
``--json`` prints the same snapshot.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from prorl_cli.protocol import STAGE_NAMES, TERMINAL_STATES, JobState, StatusReport
from prorl_cli.protocol.records import NODE_LEFT

_STATES = tuple(s.value for s in JobState)
_FINISHED = frozenset(s.value for s in TERMINAL_STATES)


@dataclass
class BackendRates:
    """One backend's figures now and per second over the last interval."""

    backend_id: str
    kind: str
    alive: bool
    paused: bool
    inflight: int
    served: int
    served_per_s: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    prompt_tokens: float
    output_tokens: float
    #: Seconds left of its rest after failing calls in a row (new calls avoid it meanwhile); 0: not resting.
    resting_s: float = 0.0
    #: Its last fault (unreachable, no answer, 5xx), if any.
    last_fault: str | None = None
    #: Why it is gone (``left``: a planned exit; else why it was lost), for a bridge that went away and has not
    #: registered again; None while registered.
    gone_reason: str | None = None


@dataclass
class Snapshot:
    """What the dashboard shows (also ``prorl top --json``)."""

    deployment: str
    uptime_s: float
    interval_s: float
    jobs: dict[str, int]
    by_task: dict[str, dict[str, int]]
    finished: int
    jobs_per_s: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    nodes: list[dict[str, Any]]
    backends: list[BackendRates]
    failures: list[dict[str, Any]]
    generation_paused: bool
    placing: bool
    held_generates: int
    metrics_url: str | None = None
    flags: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def status_flags(status: StatusReport) -> list[str]:
    """What an operator must notice at once: submits refused (the journal cannot be written), generation paused,
    generate calls held, placement held, current weights no bridge has loaded.

    ``prorl status`` and the dashboard show the same words, so both take them from here.
    """
    flags = []
    if status.journal_error is not None:
        flags.append(f"SUBMITS REFUSED: the journal cannot be written ({status.journal_error})")
    if status.generation_paused:
        flags.append("generation PAUSED")
    if status.held_generates:
        # Held because no backend is up (every bridge gone or dead) reads differently from held by a pause: the
        # first needs a bridge started (`prorl serve inference`, `prorl scale`), the second a resume.
        no_backend = not any(b.alive for b in status.backends)
        flags.append(f"{status.held_generates} generate call(s) held"
                     + (": no inference backend is up" if no_backend and not status.generation_paused else ""))
    if not status.placing:
        flags.append("placement HELD")
    w = status.weights
    if w is not None and not w.verified:
        flags.append(f"weights v{w.policy_version} UNVERIFIED: no bridge has loaded {w.checkpoint} yet")
    return flags


def _finished(status: StatusReport) -> int:
    """Jobs finished since the broker started; the held ones' count from a broker that does not report it."""
    return status.finished_total or sum(n for s, n in status.jobs.items() if s in _FINISHED)


class Dashboard:
    """Rates between successive status reports (the first report's rates are 0)."""

    def __init__(self) -> None:
        self._prev: tuple[float, StatusReport] | None = None

    def update(self, status: StatusReport, now: float | None = None) -> Snapshot:
        now = time.monotonic() if now is None else now
        prev = self._prev
        self._prev = (now, status)
        dt = now - prev[0] if prev is not None else 0.0

        def rate(new: float, old: float) -> float:
            return max(0.0, new - old) / dt if dt > 0 else 0.0

        finished = _finished(status)
        old_finished = _finished(prev[1]) if prev else finished
        old_tokens = prev[1].tokens if prev else status.tokens
        old_served = {b.backend_id: b.served for b in (prev[1].backends if prev else status.backends)}
        backends = []
        registered = {b.backend_id for b in status.backends}
        # Bridges that went away stay on the board (as `prorl status` lists them) until they register again: a
        # board whose only bridge left would otherwise show an empty table and no reason for held calls.
        gone = [b for b in status.gone_backends if b.backend_id not in registered]
        for b in [*status.backends, *gone]:
            tok = status.tokens.get(b.backend_id, {})
            otok = old_tokens.get(b.backend_id, tok)
            backends.append(BackendRates(
                backend_id=b.backend_id, kind=b.kind, alive=b.alive, paused=status.generation_paused,
                inflight=b.inflight, served=b.served, served_per_s=rate(b.served, old_served.get(b.backend_id, b.served)),
                prompt_tokens_per_s=rate(tok.get("prompt", 0.0), otok.get("prompt", 0.0)),
                output_tokens_per_s=rate(tok.get("output", 0.0), otok.get("output", 0.0)),
                prompt_tokens=tok.get("prompt", 0.0), output_tokens=tok.get("output", 0.0),
                resting_s=b.resting_s, last_fault=b.last_fault, gone_reason=b.gone_reason,
            ))
        flags = status_flags(status)
        nodes = [{"node_id": n.node_id, "alive": n.alive, "inflight": n.inflight, "credit": n.credit,
                  "stages": {s: dict(n.stages.get(s, {})) for s in STAGE_NAMES},
                  "lost_reason": n.lost_reason, "draining": n.draining} for n in status.nodes]
        return Snapshot(
            deployment=status.deployment, uptime_s=status.uptime_s, interval_s=dt, jobs=dict(status.jobs),
            by_task={t: dict(c) for t, c in status.by_task.items()}, finished=finished,
            jobs_per_s=rate(finished, old_finished),
            prompt_tokens_per_s=sum(b.prompt_tokens_per_s for b in backends),
            output_tokens_per_s=sum(b.output_tokens_per_s for b in backends),
            nodes=nodes, backends=backends, failures=list(status.failures), generation_paused=status.generation_paused,
            placing=status.placing, held_generates=status.held_generates, metrics_url=status.metrics_url, flags=flags,
        )


def _gone_cell(why: str) -> str:
    """A gone peer's state cell, as ``prorl status`` says it: a planned exit as it is, else ``lost: why`` in red."""
    from rich.markup import escape

    return escape(why) if why.startswith(NODE_LEFT) else f"[red]lost[/]: {escape(why)}"


def render(snap: Snapshot) -> Any:
    """The dashboard of ``snap`` as a rich renderable."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    head = Text.from_markup(
        f"[bold]prorl top[/] deployment [bold]{escape(snap.deployment)}[/]  up {snap.uptime_s:.0f} s  "
        f"finished {snap.finished}  [bold]{snap.jobs_per_s:.2f}[/] jobs/s  "
        f"tokens/s in [bold]{snap.prompt_tokens_per_s:.0f}[/] out [bold]{snap.output_tokens_per_s:.0f}[/]"
        + (f"  [yellow]{escape(', '.join(snap.flags))}[/]" if snap.flags else "")
        + (f"  metrics {escape(snap.metrics_url)}" if snap.metrics_url else "")
    )
    states = [s for s in _STATES if any(c.get(s) for c in snap.by_task.values()) or snap.jobs.get(s)]
    jobs = Table(title="jobs by task and state", title_justify="left")
    jobs.add_column("task")
    for s in states:
        jobs.add_column(s, justify="right")
    jobs.add_column("total", justify="right")
    for task, counts in sorted(snap.by_task.items()):
        jobs.add_row(task, *(str(counts.get(s, 0)) for s in states), str(sum(counts.values())))
    jobs.add_row("[bold]all[/]", *(str(snap.jobs.get(s, 0)) for s in states), str(sum(snap.jobs.values())))

    nodes = Table(title="nodes: stage pools active/queued/limit", title_justify="left")
    for col in ("node", "state", "inflight/credit", *STAGE_NAMES):
        nodes.add_column(col, justify="right" if col in STAGE_NAMES else "left")
    for n in snap.nodes:
        if not n["alive"]:
            # A gone node has no pools: its last figures (or zeros against a limit of 0) would read as an idle
            # node. Its row says why it is gone; its jobs were queued again or failed (the jobs table has them).
            state = _gone_cell(n.get("lost_reason") or "lost")
            nodes.add_row(escape(n["node_id"]), state, "-", *("-" for _ in STAGE_NAMES))
            continue
        cells = []
        for s in STAGE_NAMES:
            st = n["stages"].get(s) or {}
            active, limit = st.get("active", 0), st.get("limit", 0)
            style = "red" if limit and active >= limit else ""
            cell = f"{active}/{st.get('queued', 0)}/{limit}"
            cells.append(f"[{style}]{cell}[/]" if style else cell)
        nodes.add_row(escape(n["node_id"]), "[yellow]draining[/]" if n.get("draining") else "yes",
                      f"{n['inflight']}/{n['credit']}", *cells)

    backends = Table(title="inference backends", title_justify="left")
    for col in ("backend", "kind", "state", "in-flight", "served", "served/s", "tokens/s in", "tokens/s out"):
        backends.add_column(col, justify="left" if col in ("backend", "kind", "state") else "right")
    for b in snap.backends:
        state = "[red]dead[/]" if not b.alive else ("[yellow]paused[/]" if b.paused else "serving")
        if b.gone_reason is not None:  # as `prorl status` says it: a planned exit, or why it was lost
            state = _gone_cell(b.gone_reason)
        if b.alive and b.resting_s > 0:  # as `prorl backends list` says it: why new calls avoid it
            state = f"[yellow]resting {b.resting_s:.0f} s[/]: {escape(b.last_fault or '')}"
        backends.add_row(escape(b.backend_id), b.kind, state, str(b.inflight), str(b.served), f"{b.served_per_s:.1f}",
                         f"{b.prompt_tokens_per_s:.0f}", f"{b.output_tokens_per_s:.0f}")

    parts: list[Any] = [head, jobs, nodes, backends]
    if snap.failures:
        failures = Table(title="failures by task, stage and error", title_justify="left")
        for col in ("task", "stage", "error", "count", "sample message"):
            failures.add_column(col, justify="right" if col == "count" else "left", overflow="ellipsis",
                                no_wrap=col == "sample message")
        for f in snap.failures[:10]:
            failures.add_row(escape(f["task"]), escape(f["stage"]), escape(f["type"]), str(f["count"]),
                             escape(f["sample"].splitlines()[0] if f["sample"] else ""))
        parts.append(failures)
    return Group(*parts)


def watch(fetch: Callable[[], StatusReport], console: Any, interval_s: float = 1.0,
          frames: int | None = None) -> int:
    """Show the dashboard live until Ctrl-C (or ``frames`` refreshes); return how many frames were drawn.

    Ctrl-C is taken between frames (a status request is never torn in half); a second one interrupts at once.
    """
    from rich.live import Live

    board = Dashboard()
    stop = threading.Event()
    previous = signal.getsignal(signal.SIGINT)

    def on_interrupt(signum: int, frame: Any) -> None:
        stop.set()
        signal.signal(signal.SIGINT, previous)

    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        signal.signal(signal.SIGINT, on_interrupt)
    drawn = 0
    try:
        if not console.is_terminal:
            # Piped or redirected: one frame after another (a log of the run), no cursor movement.
            while (frames is None or drawn < frames) and not (drawn and stop.wait(interval_s)):
                console.rule(time.strftime("%H:%M:%S"))
                console.print(render(board.update(fetch())))
                drawn += 1
        else:
            with Live(render(board.update(fetch())), console=console, auto_refresh=False, transient=False) as live:
                drawn = 1
                while (frames is None or drawn < frames) and not stop.wait(interval_s):
                    live.update(render(board.update(fetch())), refresh=True)
                    drawn += 1
    finally:
        if in_main:
            signal.signal(signal.SIGINT, previous)
    if stop.is_set():
        console.print("stopped")
    return drawn
