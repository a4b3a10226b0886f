"""``prorl inspect``: read trajectories in the terminal, call by call.

For each selected result: its state, reward, failure and stage times; then
each model call: its agent and conversation where the trajectory names them,
the prompt tokens new in that call (the whole prompt for the first call of a
conversation, or when continuity broke), the output, decoded (with a
tokenizer) or as ids, token boundaries on request, a log-prob summary, the
tool calls the output made and the observations that followed; and the
trajectory's continuity violations, which are never hidden.

A job of several conversations (a main agent and its sub-agents through the
gateway, or a history edit) records each call's conversation in its
``segment``; a call extends the previous call *of its conversation*, not the
job's previous call, so that is what its new tokens are counted against. The
trajectory's ``messages`` are those of its last call's conversation, so the
observations go to that conversation's calls.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass, field
from typing import Any

from prorl_cli.protocol import JobResult


@dataclass
class Filters:
    """Which results to show: job id globs, tasks, states, a reward range, only those with violations."""

    job_ids: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    states: tuple[str, ...] = ()
    min_reward: float | None = None
    max_reward: float | None = None
    violations_only: bool = False
    limit: int | None = None

    def select(self, results: list[JobResult]) -> list[JobResult]:
        out = []
        for r in results:
            if self.job_ids and not any(fnmatch.fnmatchcase(r.job_id, p) for p in self.job_ids):
                continue
            if self.tasks and r.task not in self.tasks:
                continue
            if self.states and r.state not in self.states:
                continue
            if self.min_reward is not None and (r.reward is None or r.reward < self.min_reward):
                continue
            if self.max_reward is not None and (r.reward is None or r.reward > self.max_reward):
                continue
            if self.violations_only and not violations(r):
                continue
            out.append(r)
        return out[: self.limit] if self.limit is not None else out


def trajectory_of(r: JobResult) -> dict[str, Any] | None:
    """The token-level trajectory in a result's output, if it has one."""
    traj = r.output.get("trajectory") if isinstance(r.output, dict) else None
    return traj if isinstance(traj, dict) else None


def segment_of(call: dict[str, Any]) -> int:
    """The conversation (token buffer) a recorded call belongs to: its ``segment``, 0 where it has none (a
    trajectory of one conversation, or one written before calls carried it)."""
    seg = call.get("segment")
    return seg if isinstance(seg, int) and not isinstance(seg, bool) else 0


def previous_in_conversation(calls: list[Any]) -> list[int | None]:
    """Per call, the index of the previous call of its conversation (None for a conversation's first call)."""
    last: dict[int, int] = {}
    out: list[int | None] = []
    for i, call in enumerate(calls):
        seg = segment_of(call) if isinstance(call, dict) else 0
        out.append(last.get(seg))
        last[seg] = i
    return out


def violations(r: JobResult) -> list[dict[str, Any]]:
    """The trajectory's continuity violations, plus a line for each call marked not prefix-exact without one."""
    traj = trajectory_of(r)
    if traj is None:
        return []
    found = [v for v in traj.get("violations") or [] if isinstance(v, dict)]
    listed = {v.get("call") for v in found}
    calls = list(traj.get("calls") or [])
    for i, (call, prev) in enumerate(zip(calls, previous_in_conversation(calls), strict=True)):
        if isinstance(call, dict) and call.get("prefix_ok") is False and i not in listed:
            what = (f"is not a token-exact extension of call {prev} (its conversation's previous call)"
                    if prev is not None else f"marked not token-exact, the first call of conversation {segment_of(call)}")
            found.append({"call": i, "message": f"call {i}: prompt {what}"})
    return found


@dataclass
class CallView:
    """One model call as shown: new prompt ids, output ids, log-prob summary, tool calls, observations."""

    index: int
    #: The conversation (token buffer) the call extends, and the agent that made it (None: unnamed).
    segment: int
    agent: str | None
    backend: str | None
    finish_reason: str | None
    prompt_len: int
    new_prompt_ids: list[int]
    output_ids: list[int]
    text: str
    prefix_ok: bool
    logprob_mean: float | None
    logprob_min: float | None
    min_at: int | None
    tool_calls: list[str] = field(default_factory=list)
    observations: list[dict[str, Any]] = field(default_factory=list)
    #: The stop string that ended the call (None: it ended otherwise, or the record predates the field).
    stop_string: str | None = None
    #: How the gateway sampled the call, where that was not plainly: under a constraint (its log-probs are the
    #: masked distribution's), after discarded turns (``format_retried``, ``tool_choice_retries``), unmet.
    sampling_notes: list[str] = field(default_factory=list)

    @property
    def finish(self) -> str:
        """The finish reason as shown: ``stop at "</answer>"`` when a stop string ended the call."""
        if self.stop_string is None:
            return str(self.finish_reason)
        return f"{self.finish_reason} at {json.dumps(self.stop_string, ensure_ascii=False)}"


def call_views(traj: dict[str, Any]) -> list[CallView]:
    """Each call of ``traj`` with what it added to the prompt and what followed it."""
    from prorl_cli.agent.tools import get_tool_parser

    parser = get_tool_parser("hermes")
    calls = [c for c in traj.get("calls") or [] if isinstance(c, dict)]
    # The messages are the last call's conversation's: its k-th assistant turn is that conversation's k-th call.
    last_seg = segment_of(calls[-1]) if calls else 0
    own = [i for i, c in enumerate(calls) if segment_of(c) == last_seg]
    observed = dict(zip(own, _observations(traj.get("messages") or [], len(own)), strict=False))
    views = []
    # Per conversation, its last call's prompt + output: what its next call extends (calls of other
    # conversations, a sub-agent's, come in between).
    prev_end: dict[int, list[int]] = {}
    for i, c in enumerate(calls):
        prompt = list(c.get("prompt_ids") or [])
        output = list(c.get("output_ids") or [])
        ok = bool(c.get("prefix_ok", True))
        seg = segment_of(c)
        held = prev_end.get(seg)
        new = prompt[len(held):] if held is not None and ok and prompt[: len(held)] == held else prompt
        # Indices stay those of the output tokens; -inf (a token the engine gave no chance) is kept, as the
        # least likely token is what a reader looks for; NaN and missing entries are left out.
        lp_at = [(k, float(x)) for k, x in enumerate(c.get("logprobs") or [])
                 if isinstance(x, int | float) and not isinstance(x, bool) and not math.isnan(x)]
        lps = [x for _, x in lp_at]
        min_at = min(lp_at, key=lambda kx: kx[1])[0] if lp_at else None
        text = str(c.get("text") or "")
        agent = c.get("agent")
        views.append(CallView(
            index=i, segment=seg, agent=agent if isinstance(agent, str) else None, backend=c.get("backend_id"), finish_reason=c.get("finish_reason"), prompt_len=len(prompt),
            new_prompt_ids=new, output_ids=output, text=text, prefix_ok=ok,
            logprob_mean=sum(lps) / len(lps) if lps else None, logprob_min=min(lps) if lps else None,
            min_at=min_at,
            tool_calls=[f"{tc.name}({tc.arguments})" if not tc.error else f"unparsable: {tc.error}" for tc in parser.parse(text)],
            observations=observed.get(i, []),
            stop_string=c["stop_string"] if isinstance(c.get("stop_string"), str) else None,
            sampling_notes=_sampling_notes(c),
        ))
        prev_end[seg] = prompt + output
    return views


def _sampling_notes(call: dict[str, Any]) -> list[str]:
    """What a reader of a call's log-probs and turn needs to know of how it was sampled (empty: plainly)."""
    notes = []
    structured = call.get("structured")
    if isinstance(structured, dict) and len(structured) == 1:
        notes.append(f"constrained ({next(iter(structured))}): log-probs of the masked distribution")
    if call.get("format_retried") is True:
        notes.append("a free answer outside the request's format was discarded first")
    retries = call.get("tool_choice_retries")
    if isinstance(retries, int) and not isinstance(retries, bool) and retries > 0:
        notes.append(f"{retries} turn{'s' if retries > 1 else ''} discarded first for tool_choice")
    if call.get("tool_choice_unmet") is True:
        notes.append("no turn honoured tool_choice: this is the last, as generated")
    return notes


def conversation_count(views: list[CallView]) -> int:
    """How many conversations (token buffers) the calls belong to: more than one for a job with sub-agents."""
    return len({v.segment for v in views})


def conversation_label(view: CallView, several: bool) -> str:
    """``agent NAME, conversation N``: what a call is labelled with where the trajectory names an agent or holds
    several conversations ("" otherwise: a one-conversation trajectory reads as before)."""
    parts = ([f"agent {view.agent}"] if view.agent is not None else []) + ([f"conversation {view.segment}"] if several else [])
    return ", ".join(parts)


def _observations(messages: list[Any], n_calls: int) -> list[list[dict[str, Any]]]:
    """The messages after each assistant message, up to the next one (tool results, user turns)."""
    out: list[list[dict[str, Any]]] = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        if m.get("role") == "assistant":
            out.append([])
        elif out:
            out[-1].append(m)
    return out[:n_calls]


def requeues(r: JobResult) -> list[str]:
    """What its timeline says of each node a job lost (its ``requeued`` events), oldest first:
    ``node n2 lost at 12.3 s (silent for 2.1 s): queued again``.

    A job whose node died ran again (``attempt`` > 1) or failed NodeLost; without these lines its result names only
    the node it ended on, and a slow or repeated run would not say why.
    """
    out = []
    for ev in r.events or []:
        if not (isinstance(ev, list | tuple) and len(ev) > 3 and ev[0] == "requeued" and isinstance(ev[3], dict)):
            continue
        attrs = ev[3]
        when = f" at {ev[1]:.1f} s" if isinstance(ev[1], int | float) else ""
        why = f" ({attrs['why']})" if attrs.get("why") else ""
        out.append(f"node {attrs.get('node') or '?'} lost{when}{why}: queued again")
    return out


class Decoder:
    """Decodes ids with a tokenizer when one is given, else shows them as ids."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def pieces(self, ids: list[int]) -> list[str]:
        """One string per token (its boundaries), or the ids."""
        if self.tokenizer is None:
            return [str(i) for i in ids]
        return [str(self.tokenizer.decode([i], skip_special_tokens=False)) for i in ids]


def render_result(r: JobResult, decoder: Decoder, *, show_tokens: bool = False, max_ids: int = 2000) -> Any:
    """The terminal view of one result (a rich renderable)."""
    from rich.console import Group
    from rich.markup import escape
    from rich.panel import Panel
    from rich.text import Text

    def tokens(ids: list[int], style: str) -> Text:
        shown = ids[-max_ids:]
        t = Text()
        if len(ids) > len(shown):
            t.append(f"… {len(ids) - len(shown)} earlier ids …\n", style="dim")
        if show_tokens:
            for k, piece in enumerate(decoder.pieces(shown)):
                t.append(piece, style=f"{style} on grey15" if k % 2 else style)
                if decoder.tokenizer is None:
                    t.append(" ")
        else:
            t.append(decoder.text(shown), style=style)
        return t

    state_style = "green" if r.state == "done" else "red"
    head = Text.from_markup(
        f"[bold]{escape(r.job_id)}[/]  task {escape(r.task)}  state [{state_style}]{r.state}[/]  "
        f"reward {r.reward if r.reward is not None else '-'}  attempt {r.attempt}  node {escape(r.node_id or '-')}  "
        + "  ".join(f"{k} {v:.3f}s" for k, v in r.stage_s.items())
    )
    parts: list[Any] = [head]
    if r.error:
        parts.append(Text.from_markup(f"[red]failed in {escape(str(r.error.get('stage')))}: "
                                      f"{escape(str(r.error.get('type')))}: {escape(str(r.error.get('message')))}[/]"))
    for line in requeues(r):
        parts.append(Text(line, style="yellow"))
    if r.log_path:
        parts.append(Text(f"job log: {r.log_path}", style="dim"))
    traj = trajectory_of(r)
    if traj is None:
        parts.append(Text("(no token-level trajectory in this result's output)", style="dim"))
        return Panel(Group(*parts), expand=True)
    views = call_views(traj)
    conversations = conversation_count(views)
    several = conversations > 1
    parts.append(Text(f"stop reason {traj.get('stop_reason')}  calls {len(traj.get('calls') or [])}  "
                      + (f"conversations {conversations}  " if several else "")
                      + f"model {traj.get('model') or '-'}", style="dim"))
    for v in views:
        lp = (f"logprobs mean {v.logprob_mean:.3f}, min {v.logprob_min:.3f} at output token {v.min_at}"
              if v.logprob_mean is not None else "no logprobs")
        mark = "" if v.prefix_ok else "  [bold red]CONTINUITY BROKEN: the whole prompt is shown[/]"
        label = conversation_label(v, several)
        parts.append(Text.from_markup(
            f"\n[bold cyan]call {v.index}[/]  " + (f"[bold]{escape(label)}[/]  " if label else "")
            + f"backend {escape(str(v.backend))}  finish {escape(v.finish)}  prompt {v.prompt_len} ids "
            f"(+{len(v.new_prompt_ids)} new)  output {len(v.output_ids)} ids  {lp}{mark}"))
        if v.sampling_notes:
            parts.append(Text("; ".join(v.sampling_notes), style="dim"))
        parts.append(Text("new prompt tokens:", style="bold"))
        parts.append(tokens(v.new_prompt_ids, "yellow"))
        parts.append(Text("output:", style="bold"))
        parts.append(tokens(v.output_ids, "green") if decoder.tokenizer is not None or show_tokens else Text(v.text, style="green"))
        for tc in v.tool_calls:
            parts.append(Text(f"tool call: {tc}", style="magenta"))
        for obs in v.observations:
            parts.append(Text(f"{obs.get('role')}{' ' + str(obs['name']) if obs.get('name') else ''}: {obs.get('content')}",
                              style="blue"))
    found = violations(r)
    for viol in found:
        parts.append(Text(f"continuity violation at call {viol.get('call')}: {viol.get('message')}", style="bold red"))
    if traj.get("error"):
        parts.append(Text(f"generate error: {traj['error']}", style="red"))
    return Panel(Group(*parts), expand=True, border_style="red" if found or r.state != "done" else "blue")
