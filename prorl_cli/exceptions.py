"""The one exception hierarchy of prorl.

Every error prorl raises derives from :class:`ProrlError`; where a builtin
exception means the same thing, the subclass inherits it too, so callers can
catch either (``except TimeoutError`` catches :class:`StageTimeout`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prorl_cli.observe.failures import FailureGroup
    from prorl_cli.rendezvous import StopRecord


class ProrlError(Exception):
    """Root of every prorl error."""


def one_line(message: str) -> str:
    """An error ``message`` on one line: a multi-line one (a YAML parser's, with its source excerpt) joined with ``; ``.

    A caret line (``^`` under the column) means nothing once its line is joined, so it is left out.
    """
    lines = [line.strip() for line in message.splitlines()]
    return "; ".join(line for line in lines if line and line != "^")


class ConfigError(ProrlError, ValueError):
    """A configuration file, key or flag is invalid; the message names it."""


class RunIdTaken(ConfigError):
    """A sampler's ``run_id`` names job ids the broker holds with other work (another run's, or an earlier one's)."""


class ProtocolError(ProrlError, ValueError):
    """A frame or message does not follow prorl's wire protocol."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ProtocolDeclarationError(ProrlError, TypeError):
    """A header or record class declares a wire field without its check (a programming error, raised at import)."""


class RemoteError(ProrlError, RuntimeError):
    """The broker (or another peer) answered a request with an error.

    :meth:`from_reply` is the one place an error reply becomes an exception;
    the error code picks the subclass (``except KeyError`` catches an unknown
    job id, ``except InferenceError`` a failed generate).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[type[RemoteError], tuple[str, str]]:
        return type(self), (self.code, self.message)

    @staticmethod
    def from_reply(header: dict[str, Any]) -> RemoteError:
        """The exception an ``ok: false`` reply stands for (its ``error: {code, message}``, however malformed)."""
        raw = header.get("error")
        error: dict[str, Any] = raw if isinstance(raw, dict) else {}
        code = str(error.get("code") or "error")
        message = str(error.get("message") or raw or header)
        cls = _ERROR_CLASSES.get(code, RemoteError)
        return cls(code, message)


class BadRequest(RemoteError, ValueError):
    """The broker refused a request as malformed (bad frame, unknown op, missing or bad field), or the client
    refused it before sending it, for what the broker would refuse (:class:`RequestRefused`)."""


class RequestRefused(ProtocolError, BadRequest):
    """A request the client refused before sending it, for what the broker would refuse: a bad field (a sampling
    parameter out of range), an instance msgpack cannot carry, a message too big for the broker.

    Both the :class:`ProtocolError` it always was (``except ProtocolError`` goes on catching it) and the
    :class:`BadRequest` the broker's refusal of the same request is, so one ``except BadRequest`` catches a bad
    request wherever it was found.
    """

    def __init__(self, code: str, message: str) -> None:
        # Both bases take (code, message) but pass one string up: cooperative calls would hand RemoteError one
        # argument. The message and attributes are theirs.
        Exception.__init__(self, f"{code}: {message}")
        self.code = code
        self.message = message


class HeaderTooLarge(RequestRefused):
    """A message whose header frame packs past the protocol's ``MAX_HEADER_BYTES``, refused before it is sent:
    the broker could not read even its request id, so it could only be waited out."""


class UnknownJob(RemoteError, KeyError):
    """The broker does not know a job id (or a task, or the peer) the request named."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message plain.
        return f"{self.code}: {self.message}"


class BrokerStopping(RemoteError):
    """The broker is stopping and takes no new work."""


class DrainTimeout(RemoteError, TimeoutError):
    """``pause_generation(wait=True)`` ran out of time with generate calls still in flight (the message names them).

    Generation stays paused; ``running`` lists the calls (``job_id``, ``backend_id``, ``running_s``) when known.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)
        self.running: list[dict[str, Any]] = []


class ReloadFailed(RemoteError):
    """A backend could not load new weights in place (the message names it and says why).

    ``failed`` maps each such backend id to its reason, when known.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)
        self.failed: dict[str, str] = {}


class JournalUnwritable(RemoteError, OSError):
    """The broker cannot write its journal (a full disk, a lost mount): it takes no new jobs until it can.

    Raised to a client whose submit it refused; nothing of that submit was accepted: submit it again later.
    """


class JournalWriteError(ProrlError, OSError):
    """The broker's journal could not be written (the broker's side of :class:`JournalUnwritable`)."""


class StartTimeout(ProrlError, TimeoutError):
    """A process of an embedded deployment did not come up in time, or died starting (the message ends with its log)."""


class DeploymentBusy(ProrlError, RuntimeError):
    """Another broker already serves this deployment (it holds the deployment's lock)."""


class DeploymentStopped(ProrlError, RuntimeError):
    """The deployment was stopped on purpose while this peer waited for its broker: none is coming."""

    def __init__(self, record: StopRecord) -> None:
        super().__init__(f"the deployment was stopped ({record.describe()})")
        self.record = record


class CheckpointNotFound(ProrlError, FileNotFoundError):
    """``update_weights`` named a checkpoint that is not there: the bridges would be sent a path none can load."""


class CheckpointNotADirectory(CheckpointNotFound, NotADirectoryError):
    """``update_weights`` named a file (a ``config.json``, one weights file) where a checkpoint, a model directory,
    goes: no model directory is there, so ``except CheckpointNotFound`` catches it too."""


class BrokerUnavailable(ProrlError, ConnectionError):
    """No broker answered at the rendezvous address in time."""


class BrokerBusy(BrokerUnavailable):
    """A broker whose process is alive on this host left a ping unanswered for ``waited_s``: stuck or starved."""

    def __init__(self, message: str, pid: int, waited_s: float) -> None:
        super().__init__(message)
        self.pid = pid
        self.waited_s = waited_s


class BrokerRefused(BrokerUnavailable, ConnectionRefusedError):
    """The broker's socket refused this peer's CURVE handshake: missing keys, or another deployment's."""


class ProtocolMismatch(BrokerUnavailable):
    """The broker speaks another protocol version: it runs another prorl than this peer."""


class BrokerRestarted(BrokerUnavailable):
    """The broker a request went to died; a new one (started on the same address) never saw it."""


class BadAddress(ProrlError, ValueError):
    """A broker address ZeroMQ cannot connect to (no ``tcp://``, no port)."""


class ResultTimeout(ProrlError, TimeoutError):
    """No result came for a job (or a stream's jobs) within the ``timeout_s`` asked for; the jobs go on."""


class ClientMisuse(ProrlError, RuntimeError):
    """A client used where it cannot work: from another thread while in use, in another event loop, after a fork.

    The message names the rule; a new client in that thread, loop or process works.
    """


class ClientClosed(ProrlError, RuntimeError):
    """A client was used after ``close()`` (or after its ``with`` block)."""


class SamplerClosed(ClientClosed):
    """A DAPO sampler's ``step()`` after its ``close()``."""


class RendezvousError(ProrlError, FileNotFoundError):
    """The deployment's rendezvous file is missing or unreadable."""


class UnknownTask(ProrlError, KeyError):
    """No handler is registered under the requested task name."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message plain.
        return str(self.args[0]) if self.args else "unknown task"


class TaskNotServed(UnknownJob, UnknownTask):
    """The broker refused a submit for a task no live node serves (error code ``unknown_task``; the message names
    the tasks served).

    An :class:`UnknownTask`, as the same mistake is on a node, and still the :class:`UnknownJob` the broker's
    ``unknown_task`` reply was raised as before, so ``except UnknownJob`` clauses go on catching it.
    """


class AgentLoopError(ProrlError, RuntimeError):
    """The agent loop's token buffer was used out of order (``add_messages()`` without a ``generate()`` before it)."""


class UnknownToolParser(ProrlError, KeyError):
    """No tool parser is registered under the requested name (the message names the registered ones)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message plain.
        return str(self.args[0]) if self.args else "unknown tool parser"


class HandlerError(ProrlError, RuntimeError):
    """A handler could not be loaded or is malformed."""


class StageTimeout(ProrlError, TimeoutError):
    """A job's stage ran past its budget (only in-stage time counts)."""


class InvalidTimer(ProrlError, ValueError):
    """A handler asked the node's event loop for a NaN or infinite timer (sleep, timeout)."""


class InferenceError(ProrlError, RuntimeError):
    """A generate call failed (backend gone, server error, context too long)."""


class BackendFault(InferenceError):
    """The backend itself failed a call: it could not be reached, did not answer in time, or answered with a
    server error (HTTP 5xx). The broker rests an HTTP backend that fails calls in a row."""


class ContextLengthExceeded(InferenceError):
    """A prompt leaves no room to generate: it is as long as the model's context, or longer.

    Retrying cannot help; an agent must shorten its conversation. The message names both lengths
    (:func:`context_length_message`), which :meth:`lengths` reads back, also from a remote backend's error.
    """

    def lengths(self) -> tuple[int, int] | None:
        """``(prompt tokens, the model's maximum context length)``, when the message names them."""
        found = _CONTEXT_LENGTHS.search(str(self))
        return (int(found.group(1)), int(found.group(2))) if found else None


def context_length_message(prompt_tokens: int, max_model_len: int, detail: str = "") -> str:
    """What every engine says of a prompt that leaves no room to generate (:class:`ContextLengthExceeded`)."""
    extra = f" ({detail})" if detail else ""
    return (f"prompt of {prompt_tokens} tokens leaves no room to generate: the model's maximum context length is "
            f"{max_model_len} tokens{extra}")


_CONTEXT_LENGTHS = re.compile(r"prompt of (\d+) tokens leaves no room to generate: the model's maximum context "
                              r"length is (\d+) tokens")


class JobEnded(InferenceError):
    """The broker ended the job a generate call was for (cancelled, timed out, moved off this node) and stopped
    the call. The node's cancel for the job is on its way: an agent loop ends as cancelled, not as an error."""


class BackendFailed(RemoteError, InferenceError):
    """The broker answered a generate call with an error (backend gone or failing)."""


class BackendContextLengthExceeded(RemoteError, ContextLengthExceeded):
    """The backend refused a generate call's prompt as too long for the model (:class:`ContextLengthExceeded`)."""


class SandboxError(ProrlError, RuntimeError):
    """A sandbox could not be started, used or stopped."""


class SandboxTimeout(SandboxError, TimeoutError):
    """A sandbox start or tool call ran past its timeout."""


class ToolError(SandboxError):
    """A tool call was refused (no match for str_replace, missing file, bad argument)."""


class ImageBuildError(ProrlError, RuntimeError):
    """An image build failed; the message holds the failing step and log tail."""


class SlurmError(ProrlError, RuntimeError):
    """A Slurm command failed, or a deployment could not be launched, scaled or taken down."""


class PlanError(ProrlError, ValueError):
    """A workload, results file or cluster shape ``prorl plan`` cannot use; the message names the file, line or field."""


class DomainError(ProrlError, ValueError):
    """A task instance or a domain setting that a domain handler cannot use (names the field)."""


class SettingsError(DomainError):
    """A handler setting (class defaults, prorl.yaml ``handlers.<task>``, an instance's ``settings``) is invalid.

    The message names where the setting came from, the key and the keys that
    exist. It derives from :class:`DomainError` (and so from ``ValueError``)
    because settings errors were raised as that before, and handlers catch it.
    """


class HarnessExited(ProrlError, RuntimeError):
    """An agent harness (the ``harness`` task) ended in error: it exited non-zero, or the shell recording its exit
    code was killed.

    Recorded, not raised: as a ``ContextLengthExceeded`` that ends ``ctx.agent()``, it goes into
    ``trajectory.error`` (``{call, type, message}``) with ``stop_reason`` ``error``, and the job is still
    scored (a crashed agent may have left work worth scoring); ``prorl submit`` lists such jobs apart.
    """


class SamplerError(ProrlError, RuntimeError):
    """A DAPO sampler step stopped short of its target: going on would only spend rollouts for nothing, or
    the step ran out of its time.

    The message says what the step tried and names the ``SamplerConfig`` setting that stopped it
    (:attr:`setting`, now :attr:`limit`; the two bounds are off at 0, ``step_timeout_s`` at None).
    :attr:`failures` groups the failed results that led to it (stage, error type, first message line, an
    example job id), the largest first; :attr:`other_failures` counts those beyond the groups kept. The
    step's jobs still in flight keep running until the sampler is closed (``close()`` cancels them).
    Copied and pickled whole (a trainer's worker process may raise it).
    """

    def __init__(self, message: str, *, setting: str = "", limit: float = 0, step: int = 0,
                 failures: list[FailureGroup] | None = None, other_failures: int = 0) -> None:
        super().__init__(message)
        self.setting = setting
        self.limit = limit
        self.step = step
        self.failures: list[FailureGroup] = list(failures or [])
        self.other_failures = other_failures


class StepGroupsExhausted(SamplerError):
    """A step submitted ``SamplerConfig.max_groups_per_step`` groups and all finished without ``target_groups``
    informative ones among them (verl's ``filter_groups.max_num_gen_batches``): the task's rewards never vary
    (a reward that is always the same), or too rarely for the bound."""


class RolloutsFailing(SamplerError):
    """``SamplerConfig.max_consecutive_failures`` job results in a row failed, none finished between them: the
    task fails every rollout (a misconfigured handler, a backend gone); :attr:`failures` says why."""


class SamplerTimeout(SamplerError, TimeoutError):
    """A step did not reach its target within ``SamplerConfig.step_timeout_s`` (:attr:`setting`); its message
    says how far it got, and :attr:`failures` groups the step's failed results."""


class DatasetError(ProrlError, ValueError):
    """A dataset file that cannot be loaded (names the file, the line or row, and the field)."""


class LedgerError(ProrlError, ValueError):
    """A simulated engine's call ledger that cannot be read (names the file and the field)."""


#: Error code (``protocol.ErrorCode`` values) -> the exception :meth:`RemoteError.from_reply` raises.
_ERROR_CLASSES: dict[str, type[RemoteError]] = {
    "bad_frame": BadRequest,
    "bad_version": BadRequest,
    "unknown_op": BadRequest,
    "missing_field": BadRequest,
    "bad_field": BadRequest,
    "unknown_job": UnknownJob,
    "unknown_task": TaskNotServed,
    "unknown_peer": UnknownJob,
    "backend_error": BackendFailed,
    "context_length_exceeded": BackendContextLengthExceeded,
    "shutting_down": BrokerStopping,
    "journal_unwritable": JournalUnwritable,
    "drain_timeout": DrainTimeout,
    "reload_failed": ReloadFailed,
}
