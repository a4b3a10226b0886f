"""The protocol's records: typed job specs, results, sampling and status, and their wire (msgpack map) forms.

A record read off the wire is checked by its schema (:mod:`prorl_cli.protocol.schema`) while it is built,
so a record in hand is valid: nothing downstream checks its fields again. One built in Python is
trusted to follow its annotations (mypy checks them); :class:`SamplingParams` also checks its
fields' ranges when built, raising ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Self

from prorl_cli.exceptions import ProtocolError
from prorl_cli.protocol.checks import BIG, Bool, Int, List, Str, record_of
from prorl_cli.protocol.framing import ErrorCode, JobState

#: Job ids, as the ``forget`` reply lists them (its fields are declared with their checks, as a header's are).
JOB_IDS = List(Str())

#: The schema checker that reads each checked record class off the wire (filled in by the schema module).
RECORD_CHECKS: dict[type, Callable[[Any, str], Any]] = {}

#: Field names per record class, computed once (``dataclasses.fields`` on every call was a hot-path cost).
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    return names


class _Record:
    """Mixin: to/from a msgpack-ready dict, rejecting wrong shapes with a named field."""

    #: Fields it does not know are dropped instead of refused: records only the broker sends its clients (the
    #: status report and what it holds), which a newer broker may extend as any reply's header may be (a client
    #: one release behind the cluster's broker still reads ``status``). What peers send the broker stays strict.
    ignores_newer_fields: ClassVar[bool] = False

    def to_wire(self) -> dict[str, Any]:
        """This record as a msgpack-ready map (nested records and enums by value)."""
        out = {}
        for name in _field_names(type(self)):
            v = getattr(self, name)
            if isinstance(v, _NESTED):
                v = v.value if isinstance(v, enum.Enum) else v.to_wire()
            out[name] = v
        return out

    @classmethod
    def from_wire(cls, data: Any, what: str | None = None) -> Self:
        """The record ``data`` (a decoded map) stands for; :class:`ProtocolError` names the field that is wrong."""
        check = RECORD_CHECKS.get(cls)
        if check is not None:
            record: Self = check(data, what or cls.__name__)
            return record
        if not isinstance(data, dict):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{what or cls.__name__} must be a map, got {type(data).__name__}")
        unknown = data.keys() - _field_names(cls)
        if unknown and cls.ignores_newer_fields:
            data = {k: v for k, v in data.items() if k not in unknown}
        elif unknown:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{what or cls.__name__} has unknown field(s) {sorted(unknown)}")
        try:
            return cls(**data)
        except TypeError as e:
            raise ProtocolError(ErrorCode.MISSING_FIELD, f"{what or cls.__name__}: {e}") from e


#: Field values that :meth:`_Record.to_wire` converts (a tuple: ``isinstance`` is faster with one than with a union).
_NESTED = (enum.Enum, _Record)


@dataclass
class ForgetOutcome(_Record):
    """The ``forget`` reply: results dropped, jobs still unfinished (kept), ids the broker does not know."""

    forgotten: Annotated[list[str], JOB_IDS] = field(default_factory=list)
    running: Annotated[list[str], JOB_IDS] = field(default_factory=list)
    unknown: Annotated[list[str], JOB_IDS] = field(default_factory=list)


#: Most alternatives per output token a generate call may ask for (OpenAI's ``top_logprobs`` limit).
MAX_TOP_LOGPROBS = 20
#: Most stop strings one generate call may carry (``SamplingParams.stop``), and the most characters in each:
#: every one is searched for in the output's text after every sampled token.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
#: What ``SamplingParams.structured`` may constrain the output to: a JSON schema, any JSON object, a regular
#: expression, one of a list of strings, or a grammar (EBNF/Lark, as vLLM reads it); one of them per call.
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
#: The most characters a regex or grammar may have, strings a choice may list, and bytes a JSON schema packs to.
MAX_STRUCTURED_CHARS = 65536
MAX_STRUCTURED_CHOICES = 256
MAX_STRUCTURED_BYTES = 65536


def derive_seed(seed: int, n: int) -> int:
    """The ``n``-th seed derived from ``seed``: a hash of the two, in ``[0, 2^62]`` (the wire's range).

    The one rule for seeds made from a given one: rollout ``n`` of a seeded submission or sampler run, retry
    ``n`` of a turn. The same pair gives the same seed on every rerun; different pairs give unrelated ones,
    so a run seeded ``s + 1`` shares no rollouts with one seeded ``s``, and a rollout's retried turn does not
    sample what a sibling rollout sampled.
    """
    digest = hashlib.blake2b(f"{seed}:{n}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (BIG + 1)


def check_structured(structured: Any) -> None:
    """Refuse a constraint no engine could apply: not a map holding exactly one of :data:`STRUCTURED_KINDS`, or
    that one of the wrong shape."""
    if not isinstance(structured, dict) or len(structured) != 1 or next(iter(structured)) not in STRUCTURED_KINDS:
        raise ValueError(f"sampling.structured must be a map with exactly one of {', '.join(STRUCTURED_KINDS)}, "
                         f"got {structured!r:.200}")
    ((kind, value),) = structured.items()
    where = f"sampling.structured.{kind}"
    if kind == "json" and not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON schema (a map), got {type(value).__name__}")
    if kind == "json_object" and value is not True:
        raise ValueError(f"{where} must be true, got {value!r:.80}")
    if kind in ("regex", "grammar") and not (isinstance(value, str) and 1 <= len(value) <= MAX_STRUCTURED_CHARS):
        raise ValueError(f"{where} must be a string of 1 to {MAX_STRUCTURED_CHARS} characters")
    if kind == "choice" and not (isinstance(value, list) and 1 <= len(value) <= MAX_STRUCTURED_CHOICES
                                 and all(isinstance(c, str) and 1 <= len(c) <= MAX_STOP_CHARS for c in value)):
        raise ValueError(f"{where} must be a list of 1 to {MAX_STRUCTURED_CHOICES} strings, each 1 to "
                         f"{MAX_STOP_CHARS} characters")


def _check_stop(stop: Any) -> None:
    """Refuse stop strings no engine could match: not a list of strings, too many, empty or too long ones."""
    if not isinstance(stop, list):
        raise ValueError(f"sampling.stop must be a list of strings, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"sampling.stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS}")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise ValueError(f"sampling.stop[{i}] must be a string, got {type(s).__name__}")
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            # An empty string would be completed by the first token (vLLM refuses one too).
            raise ValueError(f"sampling.stop[{i}] must have 1 to {MAX_STOP_CHARS} characters, got {len(s)}")


@dataclass
class SamplingParams(_Record):
    """Sampling of one generate call (the generate contract); a value out of range raises ``ValueError`` naming it."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    #: Keep sampling past end-of-sequence tokens (fixed-length generations); ``stop_token_ids`` still stop.
    ignore_eos: bool = False
    #: Alternatives per output token to return with the sampled one (``Generation.top_logprobs``), 0 to 20;
    #: ``None`` or 0: none. Engines that cannot return them ignore it.
    top_logprobs: int | None = None
    #: Stop strings: generation ends at the first sampled token whose text completes one of them (the text of
    #: the output ids alone, decoded with special tokens kept), and that token is the last of ``output_ids``:
    #: ids are never cut inside a token nor re-tokenized, so the last one may carry text past the string.
    #: ``finish_reason`` is then ``stop`` and ``Generation.stop_string`` the string (of those completed by that
    #: token, the one ending first in the text; on a tie, the first listed). At most 32 strings, each 1 to 1024
    #: characters. Engines and their handling: docs/inference.md ("Stop strings").
    stop: list[str] = field(default_factory=list)
    #: Constrained decoding: the output must match ``{"json": SCHEMA}``, ``{"json_object": true}``,
    #: ``{"regex": R}``, ``{"choice": [S, ...]}`` or ``{"grammar": G}`` (one of them). The engine masks what the
    #: constraint rules out before sampling, so the log-probs it returns are the masked distribution's (a token
    #: the constraint forces has log-prob 0), not the model's own. Engines that cannot constrain refuse the call.
    structured: dict[str, Any] | None = None
    #: The fields the sender gave, when read off the wire (``None``: built here, every field given).
    given: frozenset[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Values no engine could honour are refused where the record is built, whoever builds it (the
        # gateway, the agent loop, a handler), so no engine or client checks them again. Off the wire the
        # schema has already refused them with a protocol error naming the field; these checks then pass.
        # Plain comparisons, written so that NaN fails them: this runs once per generate call.
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling.top_k must be -1 (off) or positive, got {self.top_k!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"sampling.ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.top_logprobs is not None and not (
                type(self.top_logprobs) is int and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"sampling.top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {self.top_logprobs!r}")
        if self.structured is not None:
            check_structured(self.structured)
        if self.stop is None:
            self.stop = []  # none, as vLLM's None and a null off the wire (a field at its default) say
        elif self.stop:
            _check_stop(self.stop)

    @classmethod
    def from_given(cls, **fields: Any) -> SamplingParams:
        """Sampling from the fields a sender gave (the rest at their defaults), remembering which it gave.

        The wire schema calls it with checked fields; should a range ever be looser there than here, the
        peer still gets a :class:`ProtocolError` naming the field, never a bare ``ValueError``.
        """
        try:
            sampling = cls(**fields)
        except ValueError as e:
            raise ProtocolError(ErrorCode.BAD_FIELD, str(e)) from e
        sampling.given = frozenset(fields)
        return sampling

    def is_set(self, name: str) -> bool:
        """Whether ``name`` was chosen by the sender (not left at its default)."""
        return self.given is None or name in self.given

    def with_set(self, **fields: Any) -> SamplingParams:
        """A copy with ``fields`` changed and counted as chosen: given are this one's given fields and ``fields``.

        The one way to change sampling on its way to an engine: ``dataclasses.replace`` (or building a new
        record) would mark every field given, so a field the sender left out would reach the broker's KV
        admission and the engine as chosen instead of as the receiver's default. Ranges are checked as when built.
        """
        sampling = dataclasses.replace(self, **fields)
        if self.given is not None:
            sampling.given = self.given | frozenset(fields)
        return sampling

    def to_wire(self) -> dict[str, Any]:
        """The fields the sender gave (a field left at its default stays so downstream), else every field but a
        ``structured`` of None: a call without a constraint reads as before that field, to the last release too."""
        wire = super().to_wire()
        if self.given is not None:
            return {k: v for k, v in wire.items() if k in self.given}
        if wire["structured"] is None:
            del wire["structured"]
        return wire


@dataclass
class JobSpec(_Record):
    """A job as submitted. The task instance travels beside it as an opaque payload frame.

    Read off the wire with :meth:`from_wire` (the ``submit`` schema checks every field's type and range).

    ``timeout_s`` is the total in-stage budget; ``stage_timeouts_s`` optionally
    caps each stage (keys ``init``, ``run``, ``eval``). Queue waits never count.
    """

    job_id: str
    task: str
    timeout_s: float | None = None
    stage_timeouts_s: dict[str, float] | None = None
    sampling: SamplingParams | None = None
    attempt: int = 1
    max_attempts: int = 3
    #: The caller's group (e.g. the prompt of a GRPO group); echoed in the result.
    group_id: str | None = None
    #: A small map (str keys, scalar values, packed <= 4 KiB) echoed in the result.
    meta: dict[str, str | int | float | bool | None] | None = None


@dataclass
class ErrorInfo(_Record):
    """What went wrong in a stage: the stage, the exception type and its message."""

    stage: str
    type: str
    message: str


@dataclass
class JobResult(_Record):
    """The result of one job, always well formed whatever happened.

    ``output`` is what the handler's ``final_result`` returned (trajectory,
    messages, artifacts); ``reward`` is copied out of it for convenience.
    ``critical_error`` names the stage that failed (or ``None``).
    ``stage_s`` is the in-stage time of each stage; ``active_s`` their sum.
    """

    job_id: str
    task: str
    state: str
    attempt: int = 1
    node_id: str | None = None
    reward: float | None = None
    critical_error: str | None = None
    error: dict[str, str] | None = None
    stage_s: dict[str, float] = field(default_factory=dict)
    active_s: float = 0.0
    output: Any = None
    #: Echoed from the JobSpec.
    group_id: str | None = None
    meta: dict[str, Any] | None = None
    #: The job's timeline: ``[name, t_s, dur_s]`` or ``[name, t_s, dur_s, attrs]``, seconds since the broker
    #: accepted it (``prorl_cli/observe/timeline.py``, docs/observability.md); ``None`` from older peers.
    events: list[list[Any]] | None = None
    #: The job's own log file on its node (written only when the job logged something), else ``None``.
    log_path: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == JobState.DONE.value


@dataclass
class StageStats(_Record):
    """Per-stage pool counters of one node."""

    active: int = 0
    queued: int = 0
    limit: int = 0


#: The start of a gone node's ``lost_reason`` when it left on purpose: a planned exit, not a loss.
NODE_LEFT = "left"


@dataclass
class NodeStatus(_Record):
    """A node as the status report shows it."""

    ignores_newer_fields = True

    node_id: str
    host: str
    pid: int
    alive: bool
    credit: int
    inflight: int
    tasks: list[str]
    stages: dict[str, dict[str, int]] = field(default_factory=dict)
    #: ``apptainer``, ``bwrap`` or ``local`` (no isolation), as the node's ``register`` said; None when not sent.
    sandbox_runtime: str | None = None
    #: Seconds since the broker last heard from the node (its heartbeats come every interval).
    silent_s: float = 0.0
    #: Why the node is gone: lost (``silent for 2.1 s``, ``re-registered from a new connection``), or, when it
    #: said it was leaving (a drain, a scale-down, ``down``), :data:`NODE_LEFT` (``left (drained)``); None while alive.
    lost_reason: str | None = None
    #: Draining (a preemption or time-limit warning): running jobs finish, nothing new is placed on it.
    draining: bool = False


@dataclass
class BackendStatus(_Record):
    """An inference backend: a bridge (ZMQ peer) or a plain HTTP address."""

    ignores_newer_fields = True

    backend_id: str
    kind: str  # "bridge" | "http"
    url: str | None
    host: str | None
    model: str | None
    max_model_len: int | None
    inflight: int
    jobs: int
    served: int
    cleared: bool
    alive: bool
    #: Engine figures from the bridge's heartbeat ``stats`` (str -> number); empty when it sends none.
    stats: dict[str, float] = field(default_factory=dict)
    #: The weights version the bridge serves (``None``: the weights it was started on; HTTP backends: unknown).
    policy_version: int | None = None
    #: The bridge is loading the deployment's current weights (it rejoined on others): it serves no call until then.
    loading: bool = False
    #: Why a bridge is gone (in ``StatusReport.gone_backends``): :data:`NODE_LEFT` for a planned exit (a signal,
    #: a scale-down, ``down``), else why it was lost (``silent for 2.1 s``, its engine died); None while alive.
    gone_reason: str | None = None
    #: Seconds new calls still avoid this backend after it failed calls in a row (0: they do not), and the last
    #: fault a call met there (unreachable, no answer in time, HTTP 5xx); None once a call is answered again.
    resting_s: float = 0.0
    last_fault: str | None = None


@dataclass
class WeightsStatus(_Record):
    """The deployment's current weights (``StatusReport.weights``): the last ``update_weights`` every bridge loaded."""

    checkpoint: Annotated[str, Str(4096)]
    policy_version: Annotated[int, Int()]
    #: A bridge has loaded them (or registered serving their version). False: the update was answered with no bridge
    #: up to load it (none, or HTTP backends only), so nothing has shown the checkpoint loads; the first bridge to
    #: join loads it and makes it true, or is told to shut down.
    verified: Annotated[bool, Bool()]


RECORD_CHECKS[WeightsStatus] = record_of(WeightsStatus)


@dataclass
class StatusReport(_Record):
    """The broker's answer to ``status``."""

    ignores_newer_fields = True

    deployment: str
    jobs: dict[str, int]
    queued: int
    nodes: list[NodeStatus]
    backends: list[BackendStatus]
    generation_paused: bool
    placing: bool
    uptime_s: float
    #: Generate calls held at the broker (generation paused, or no backend up).
    held_generates: int = 0
    #: Finished results kept for late watchers, and their size (instances and results).
    retained_results: int = 0
    retained_bytes: int = 0
    #: The trainer's policy version, as last given to pause/resume_generation (0 until given).
    policy_version: int = 0
    #: ``broker.routing_policy``: how generate calls pick a backend.
    routing_policy: str = "least_loaded_sticky"
    #: Where the broker serves Prometheus metrics (``broker.metrics_port``), or ``None`` when off.
    metrics_url: str | None = None
    #: Jobs by task, then by state.
    by_task: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Failed jobs grouped by task, stage and error type across nodes: ``{task, stage, type, count, sample, nodes}``.
    failures: list[dict[str, Any]] = field(default_factory=list)
    #: Tokens through each backend so far, as the nodes count them: ``{backend: {"prompt": n, "output": n}}``.
    tokens: dict[str, dict[str, float]] = field(default_factory=dict)
    #: Bridges that went away and have not registered again (the latest few), each with its ``gone_reason``.
    gone_backends: list[BackendStatus] = field(default_factory=list)
    #: Jobs finished since the broker started. ``jobs`` counts only the jobs the broker still holds, which a
    #: trainer that forgets its results (and retention) keeps small: rates of finished jobs come from this.
    finished_total: int = 0
    #: Why the broker's journal cannot be written (a full disk), or ``None``: meanwhile every submit is refused.
    journal_error: str | None = None
    #: The deployment's current weights and whether a bridge has loaded them; ``None`` before any ``update_weights``.
    weights: WeightsStatus | None = None

    def to_wire(self) -> dict[str, Any]:
        """The report as a msgpack-ready map, its nodes and backends as maps."""
        wire = super().to_wire()
        wire["nodes"] = [n.to_wire() for n in self.nodes]
        wire["backends"] = [b.to_wire() for b in self.backends]
        wire["gone_backends"] = [b.to_wire() for b in self.gone_backends]
        return wire

    @classmethod
    def from_wire(cls, data: Any, what: str | None = None) -> Self:
        """The report in a ``status`` reply, its nodes and backends typed."""
        report = super().from_wire(data, what)
        report.nodes = [NodeStatus.from_wire(n, f"nodes[{i}]") for i, n in enumerate(report.nodes)]
        report.backends = [BackendStatus.from_wire(b, f"backends[{i}]") for i, b in enumerate(report.backends)]
        report.gone_backends = [BackendStatus.from_wire(b, f"gone_backends[{i}]") for i, b in enumerate(report.gone_backends)]
        if report.weights is not None:
            report.weights = WeightsStatus.from_wire(report.weights, "weights")
        return report
