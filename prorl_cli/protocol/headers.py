"""Typed headers: one class per op, what :func:`prorl_cli.protocol.schema.parse` turns a checked header into.

Each class's fields are its op's schema fields (``OP_SCHEMAS``), with the Python type the schema's
checker stands for: a required field has no default, an optional one has a default (``None``
unless the record says otherwise). ``tests/core/test_headers.py`` holds the two together, so
they cannot drift. A header in hand is valid: its handler reads attributes and checks nothing again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prorl_cli.protocol.framing import Op
from prorl_cli.protocol.records import (
    BackendStatus,
    ForgetOutcome,
    JobSpec,
    SamplingParams,
    StatusReport,
)

#: A request id: a string, or any integer msgpack carries.
Rid = str | int


# ----------------------------------------------------------------- nested records


@dataclass(slots=True)
class StageUpdate:
    """A job's new stage (``job_stage``), or a job a re-registering node still runs (``register``)."""

    job_id: str
    attempt: int
    stage: str


@dataclass(slots=True)
class JobEnd:
    """A finished job of ``job_done``; its result is the payload frame at the same index."""

    job_id: str
    attempt: int
    state: str


# ----------------------------------------------------------------- client -> broker


@dataclass(slots=True)
class Submit:
    rid: Rid
    jobs: list[JobSpec]


@dataclass(slots=True)
class JobIds:
    """``cancel``, ``watch``, ``forget`` (client), ``release`` (node)."""

    rid: Rid
    job_ids: list[str]


@dataclass(slots=True)
class ListJobs:
    rid: Rid
    prefix: str | None = None
    group_id: str | None = None
    after: int | None = None


@dataclass(slots=True)
class Request:
    """An op with nothing but its request id (``status``, ``start``, ``hold``, ``stop``, ``ping``, ...)."""

    rid: Rid


@dataclass(slots=True)
class AddLlmServer:
    rid: Rid
    url: str
    model: str | None = None


@dataclass(slots=True)
class ClearLlmServer:
    rid: Rid
    #: Absent: clear every HTTP backend.
    url: str | None = None


@dataclass(slots=True)
class PauseGeneration:
    rid: Rid
    policy_version: int | None = None
    #: Answer once the calls in flight drained (or this ran out); absent: answer at once.
    drain_timeout_s: float | None = None


@dataclass(slots=True)
class ResumeGeneration:
    rid: Rid
    policy_version: int | None = None


@dataclass(slots=True)
class UpdateWeights:
    rid: Rid
    checkpoint: str
    policy_version: int
    load_timeout_s: float | None = None


# ----------------------------------------------------------------- node / bridge -> broker


@dataclass(slots=True)
class Register:
    rid: Rid
    node_id: str
    host: str
    credit: int
    tasks: list[str]
    pid: int | None = None
    #: Jobs the node still runs (a broker that restarted learns them back).
    running: list[StageUpdate] | None = None
    liveness_token: str | None = None
    #: The sandbox runtime the node picked (``sandbox.runtime: auto`` resolved).
    sandbox_runtime: str | None = None
    #: The node is draining: a restarted broker places nothing more on it.
    draining: bool | None = None


@dataclass(slots=True)
class Heartbeat:
    """A node's or bridge's heartbeat (or a node's liveness sidecar's, with ``liveness_token``)."""

    rid: Rid | None = None
    node_id: str | None = None
    backend_id: str | None = None
    #: Per-stage pool counters: ``{stage: {active, queued, limit}}``.
    stages: dict[str, dict[str, Any]] | None = None
    inflight: int | None = None
    liveness_token: str | None = None
    #: A bridge's engine figures.
    stats: dict[str, float] | None = None
    #: Prometheus samples (docs/observability.md).
    metrics: list[list[Any]] | None = None
    #: A node's failed jobs grouped: ``{task, stage, type, count, sample}``.
    failures: list[dict[str, Any]] | None = None


@dataclass(slots=True)
class Unregister:
    rid: Rid | None = None
    node_id: str | None = None
    backend_id: str | None = None


@dataclass(slots=True)
class JobStage:
    updates: list[StageUpdate]


@dataclass(slots=True)
class JobDone:
    jobs: list[JobEnd]


@dataclass(slots=True)
class Generate:
    """A generate call (node -> broker, and broker -> bridge); payload: the prompt (int32)."""

    rid: Rid
    job_id: str
    #: Absent: the engine's defaults (:class:`SamplingParams`).
    sampling: SamplingParams | None = None
    #: The caller's host (the ``local_first`` routing policy prefers a backend there).
    host: str | None = None


@dataclass(slots=True)
class RegisterBackend:
    rid: Rid
    backend_id: str
    host: str
    model: str
    max_model_len: int | None = None
    capacity: int | None = None


@dataclass(slots=True)
class GenerateReply:
    """A bridge's answer to a forwarded generate call; payload: ids (int32) and log-probs (float32)."""

    rid: Rid
    finish_reason: str | None = None
    #: The bridge's weights version when the call ran (absent: the broker stamps its own).
    policy_version: int | None = None
    #: Seconds the call spent in the engine (queued there and generating), as the bridge timed it.
    engine_s: float | None = None
    #: ``{code, message}`` when the call failed.
    error: dict[str, Any] | None = None


@dataclass(slots=True)
class WeightsUpdated:
    rid: Rid
    error: dict[str, Any] | None = None


@dataclass(slots=True)
class GenerateDone:
    job_id: str
    backend_id: str


@dataclass(slots=True)
class GenerateCancel:
    rid: Rid
    job_id: str


# ----------------------------------------------------------------- broker -> node


@dataclass(slots=True)
class Assign:
    """Jobs placed on a node; payload: one instance per job.

    ``jobs`` stay as read here: the node reads each with ``JobSpec.from_wire`` on its own, so one bad
    record fails that job (reported FAILED) and not the jobs beside it.
    """

    jobs: list[Any]
    #: Per job: where its timeline starts (``since_submit_s``) and the broker's events so far.
    timing: list[Any] | None = None


@dataclass(slots=True)
class CancelJob:
    """Stop these jobs (the broker -> node form of ``cancel``)."""

    job_ids: list[str]


@dataclass(slots=True)
class GenerateHeld:
    rid: Rid
    job_id: str
    held: bool


@dataclass(slots=True)
class Shutdown:
    """The broker tells a node or bridge to leave."""

    rid: Rid | None = None


#: The header class of each op (several ops share one shape).
HEADERS: dict[Op, type] = {
    Op.SUBMIT: Submit,
    Op.CANCEL: JobIds,
    Op.WATCH: JobIds,
    Op.FORGET: JobIds,
    Op.LIST_JOBS: ListJobs,
    Op.STATUS: Request,
    Op.ADD_LLM_SERVER: AddLlmServer,
    Op.CLEAR_LLM_SERVER: ClearLlmServer,
    Op.LIST_LLM_SERVERS: Request,
    Op.PAUSE_GENERATION: PauseGeneration,
    Op.RESUME_GENERATION: ResumeGeneration,
    Op.UPDATE_WEIGHTS: UpdateWeights,
    Op.WEIGHTS_UPDATED: WeightsUpdated,
    Op.START: Request,
    Op.HOLD: Request,
    Op.STOP: Request,
    Op.PING: Request,
    Op.REGISTER: Register,
    Op.HEARTBEAT: Heartbeat,
    Op.UNREGISTER: Unregister,
    Op.RELEASE: JobIds,
    Op.JOB_STAGE: JobStage,
    Op.JOB_DONE: JobDone,
    Op.GENERATE: Generate,
    Op.REGISTER_BACKEND: RegisterBackend,
    Op.GENERATE_REPLY: GenerateReply,
    Op.GENERATE_DONE: GenerateDone,
    Op.GENERATE_CANCEL: GenerateCancel,
    Op.ASSIGN: Assign,
    Op.CANCEL_JOB: CancelJob,
    Op.GENERATE_HELD: GenerateHeld,
    Op.SHUTDOWN: Shutdown,
}


# ----------------------------------------------------------------- broker -> client: success replies
# What :func:`prorl_cli.protocol.schema.parse_reply` turns a success reply into (``REPLY_SCHEMAS``). A list or
# map field has a default: the client always took it as empty when absent, and still does; a wrong one is an
# error. A reply that is nothing but its record (``status``, a backend) requires it.


@dataclass(slots=True)
class SubmitReply:
    """``submit``: the ids taken as new jobs, and those the broker already had (a submit is idempotent)."""

    accepted: list[str] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)


@dataclass(slots=True)
class WatchReply:
    """``watch``: the ids the broker does not know (the others' results come as they finish)."""

    unknown: list[str] = field(default_factory=list)


@dataclass(slots=True)
class CancelReply:
    """``cancel``: each known job's state after the cancel (ids the broker does not know are absent)."""

    states: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class JobPage:
    """``list_jobs``: one page of ids and states, in submission order; ``next`` is the next page's ``after``."""

    jobs: dict[str, str] = field(default_factory=dict)
    next: int | None = None


@dataclass(slots=True)
class WeightsUpdateReply:
    """``update_weights``: bridges that loaded the weights, HTTP backends skipped, the version now served."""

    updated: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    policy_version: int | None = None


@dataclass(slots=True)
class StatusReply:
    """``status``: the broker's report."""

    status: StatusReport


@dataclass(slots=True)
class BackendReply:
    """``add_llm_server``: the backend as registered."""

    backend: BackendStatus


@dataclass(slots=True)
class ClearedReply:
    """``clear_llm_server``: the backends that take no new jobs now."""

    cleared: list[str]


@dataclass(slots=True)
class BackendList:
    """``list_llm_servers``: every backend the broker knows."""

    backends: list[BackendStatus]


#: The typed success reply of each request op the client reads (``forget``'s is the :class:`ForgetOutcome` record).
REPLIES: dict[Op, type] = {
    Op.SUBMIT: SubmitReply,
    Op.WATCH: WatchReply,
    Op.CANCEL: CancelReply,
    Op.LIST_JOBS: JobPage,
    Op.FORGET: ForgetOutcome,
    Op.UPDATE_WEIGHTS: WeightsUpdateReply,
    Op.STATUS: StatusReply,
    Op.ADD_LLM_SERVER: BackendReply,
    Op.CLEAR_LLM_SERVER: ClearedReply,
    Op.LIST_LLM_SERVERS: BackendList,
}

__all__ = [name for name, value in dict(globals()).items() if isinstance(value, type) and value.__module__ == __name__]
