"""The one exception hierarchy of prorl.

Every error prorl raises derives from :class:`ProrlError`; where a builtin
exception means the same thing, the subclass inherits it too, so callers can
catch either (``except TimeoutError`` catches :class:`StageTimeout`).
"""

from __future__ import annotations


class ProrlError(Exception):
    """Root of every prorl error."""


class ConfigError(ProrlError, ValueError):
    """A configuration file, key or flag is invalid; the message names it."""


class ProtocolError(ProrlError, ValueError):
    """A frame or message does not follow prorl's wire protocol."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class RemoteError(ProrlError, RuntimeError):
    """The broker (or another peer) answered a request with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class BrokerUnavailable(ProrlError, ConnectionError):
    """No broker answered at the rendezvous address in time."""


class BrokerRestarted(BrokerUnavailable):
    """The broker a request went to died; a new one (started on the same address) never saw it."""


class RendezvousError(ProrlError, FileNotFoundError):
    """The deployment's rendezvous file is missing or unreadable."""


class UnknownTask(ProrlError, KeyError):
    """No handler is registered under the requested task name."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message plain.
        return str(self.args[0]) if self.args else "unknown task"


class HandlerError(ProrlError, RuntimeError):
    """A handler could not be loaded or is malformed."""


class StageTimeout(ProrlError, TimeoutError):
    """A job's stage ran past its budget (only in-stage time counts)."""


class InvalidTimer(ProrlError, ValueError):
    """A handler asked the node's event loop for a NaN or infinite timer (sleep, timeout)."""


class InferenceError(ProrlError, RuntimeError):
    """A generate call failed (backend gone, server error, context too long)."""


class NoBackend(InferenceError):
    """No inference backend is registered (or all are cleared)."""


class SandboxError(ProrlError, RuntimeError):
    """A sandbox could not be started, used or stopped."""


class SandboxTimeout(SandboxError, TimeoutError):
    """A sandbox start or tool call ran past its timeout."""


class ToolError(SandboxError):
    """A tool call was refused (no match for str_replace, missing file, bad argument)."""


class ImageBuildError(ProrlError, RuntimeError):
    """An image build failed; the message holds the failing step and log tail."""

