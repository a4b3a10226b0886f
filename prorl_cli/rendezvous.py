"""The rendezvous file: how every peer finds a deployment's broker.

``$PRORL_HOME/<deployment>/broker.json`` (mode 0600) holds the broker's
address and its CURVE public key (none only with ``broker.curve: off``).

Beside it, ``stopped.json`` (:class:`StopRecord`) says the deployment was
stopped on purpose (``prorl stop``, ``prorl down``): the broker writes it when
it takes the ``stop`` op, never when a signal makes it leave (a Slurm
requeue, a time limit, a preemption: its successor is expected), and the
next broker removes it before it publishes its rendezvous file. A peer
waiting for a broker (``live``) that finds a record newer than its own start
and no broker started since stops waiting (:class:`DeploymentStopped`); a
peer started after the stop waits for the next broker as before.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prorl_cli.exceptions import DeploymentBusy, DeploymentStopped, RendezvousError
from prorl_cli.processes import pid_exists

log = logging.getLogger(__name__)

RENDEZVOUS_NAME = "broker.json"
#: Written by a broker told to stop (:class:`StopRecord`); removed by the next broker before it publishes.
STOPPED_NAME = "stopped.json"
#: Held (``flock``, exclusive) by the deployment's broker for its whole life; never deleted.
LOCK_NAME = "broker.lock"


@dataclass
class Rendezvous:
    address: str
    deployment: str
    host: str
    pid: int
    started_at: float
    curve_public_key: str | None = None

    def process_gone(self) -> bool:
        """The broker that wrote this file ran on this host and its process is gone (killed outright: a clean
        exit removes the file). False when it ran elsewhere: nothing here can tell."""
        from prorl_cli.processes import is_local_broker

        return self.host == socket.gethostname() and self.pid > 0 and not is_local_broker(self.pid)

    def process_alive(self) -> bool:
        """The broker that wrote this file runs on this host and its process is alive. False when it ran
        elsewhere: nothing here can tell."""
        from prorl_cli.processes import is_local_broker

        return self.host == socket.gethostname() and is_local_broker(self.pid)


def rendezvous_path(deployment_dir: Path) -> Path:
    return deployment_dir / RENDEZVOUS_NAME


def _write_json(path: Path, data: dict[str, object]) -> Path:
    """Write ``data`` to ``path`` atomically with mode 0600 (readers never see half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
    return path


def write_rendezvous(deployment_dir: Path, info: Rendezvous) -> Path:
    """Write the file atomically with mode 0600."""
    return _write_json(rendezvous_path(deployment_dir), asdict(info))


@dataclass
class StopRecord:
    """The deployment was stopped on purpose: by the broker at ``address`` (``pid`` on ``host``), at ``stopped_at``
    (seconds since the epoch, the broker host's clock)."""

    stopped_at: float
    host: str
    pid: int
    address: str

    def describe(self) -> str:
        """``prorl stop at 2026-12-07 06:11:56 UTC``, for log lines."""
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.stopped_at))
        return f"prorl stop at {when}"


def stopped_path(deployment_dir: Path) -> Path:
    return deployment_dir / STOPPED_NAME


def record_stop(deployment_dir: Path, address: str) -> StopRecord:
    """Say that the deployment was stopped on purpose, now (the broker, as it takes the ``stop`` op)."""
    record = StopRecord(stopped_at=time.time(), host=socket.gethostname(), pid=os.getpid(), address=address)
    _write_json(stopped_path(deployment_dir), asdict(record))
    return record


def clear_stop(deployment_dir: Path) -> None:
    """Remove the stop record (a broker starting: the deployment runs again)."""
    stopped_path(deployment_dir).unlink(missing_ok=True)


def read_stop(deployment_dir: Path) -> StopRecord | None:
    """The deployment's stop record; None when there is none, or it does not read back (waiting is the safe side)."""
    try:
        data = json.loads(stopped_path(deployment_dir).read_text())
        record = StopRecord(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:
        log.warning("%s: unreadable stop record (%s): taken for none", stopped_path(deployment_dir), e)
        return None
    if not isinstance(record.stopped_at, int | float) or isinstance(record.stopped_at, bool):
        log.warning("%s: stopped_at %r is not a number: taken for no stop record", stopped_path(deployment_dir),
                    record.stopped_at)
        return None
    return record


def stopped_since(deployment_dir: Path, started_at: float, current: Rendezvous | None = None) -> StopRecord | None:
    """The stop record when the deployment was stopped after ``started_at`` (seconds since the epoch: a peer's
    start) and no broker started since (``current``: the rendezvous file, if one was read); else None.

    A stop before ``started_at`` is none of this peer's business: it was started for the next broker.
    """
    record = read_stop(deployment_dir)
    if record is None or record.stopped_at <= started_at:
        return None
    if current is not None and current.started_at > record.stopped_at:
        return None  # a broker started after the stop (it removes the record; this one read it first)
    return record


def process_started_at() -> float:
    """When this process started (seconds since the epoch): the kernel's start time of it, else this module's import.

    A peer's own start, not the moment it began to wait: a stop while it imported and loaded its engine counts.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            # Field 22 (starttime, clock ticks since boot), counted after the ")" that ends the command name.
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED_AT
    return time.time() - max(0.0, age_s)


_IMPORTED_AT = time.time()


def read_rendezvous(deployment_dir: Path) -> Rendezvous:
    path = rendezvous_path(deployment_dir)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise RendezvousError(
            f"{path}: no rendezvous file; is the broker of deployment {deployment_dir.name!r} running?"
        ) from e
    except (OSError, ValueError) as e:
        raise RendezvousError(f"{path}: unreadable rendezvous file: {e}") from e
    try:
        info = Rendezvous(**data)
    except TypeError as e:
        raise RendezvousError(f"{path}: malformed rendezvous file: {e}") from e
    problem = _malformed(info)
    if problem is not None:
        raise RendezvousError(f"{path}: malformed rendezvous file: {problem}")
    return info


def _malformed(info: Rendezvous) -> str | None:
    """What is wrong with the fields of a file that parsed (written by hand, say, or by something else), or None."""
    if not isinstance(info.address, str) or "://" not in info.address:
        return f"address {info.address!r} is not a ZeroMQ endpoint (transport://where, as tcp://host:port)"
    for name in ("deployment", "host"):
        if not isinstance(getattr(info, name), str):
            return f"{name} {getattr(info, name)!r} is not a string"
    if not isinstance(info.pid, int) or isinstance(info.pid, bool):
        return f"pid {info.pid!r} is not an integer"
    if not isinstance(info.started_at, int | float) or isinstance(info.started_at, bool):
        return f"started_at {info.started_at!r} is not a number"
    if info.curve_public_key is not None and not isinstance(info.curve_public_key, str):
        return f"curve_public_key {info.curve_public_key!r} is not a string"
    return None


def _read_by(deployment_dir: Path, deadline: float, live: bool = False) -> Rendezvous | None:
    """The rendezvous file; None while it is not there yet, its error once ``deadline`` (monotonic) is past.

    ``live``: a file naming a broker of this host whose pid no process has (killed without cleaning up) counts
    as not there yet: its successor (a restart, a supervisor's replacement) writes its own. And a stop record
    newer than this process and than the broker the file names (:func:`stopped_since`) raises
    :class:`DeploymentStopped`: no successor is coming, and a broker that is stopping is not one to join. Only the pid is
    asked, not :meth:`Rendezvous.process_gone`'s command line: a broker Slurm started through submitit does
    not look like ``prorl serve broker``, and would be waited past for ever.
    """
    try:
        info = read_rendezvous(deployment_dir)
    except RendezvousError:
        if live:
            raise_if_stopped(deployment_dir, None)
        if time.monotonic() >= deadline:
            raise
        return None
    if live:
        raise_if_stopped(deployment_dir, info)
    if live and info.host == socket.gethostname() and info.pid > 0 and not pid_exists(info.pid):
        if time.monotonic() >= deadline:
            raise RendezvousError(f"{rendezvous_path(deployment_dir)} names the broker pid {info.pid} on this host, "
                                  f"whose process is gone (killed without cleaning up): start it again, `prorl serve "
                                  f"broker -d {info.deployment}`")
        return None
    return info


def raise_if_stopped(deployment_dir: Path, current: Rendezvous | None = None) -> None:
    """:class:`DeploymentStopped` when the deployment was stopped on purpose since this process started and no
    broker started since (``current``: the rendezvous file, if one was read). For every loop that waits for a
    broker: one that finds the record stops waiting (a peer's exit code 0: it was asked to go)."""
    record = stopped_since(deployment_dir, process_started_at(), current)
    if record is not None:
        raise DeploymentStopped(record)


def wait_rendezvous(deployment_dir: Path, timeout_s: float, *, live: bool = False) -> Rendezvous:
    """Poll for the rendezvous file (it appears once the broker has bound its socket); ``live``: see :func:`_read_by`."""
    deadline, delay_s = time.monotonic() + timeout_s, 0.02
    while (info := _read_by(deployment_dir, deadline, live)) is None:
        time.sleep(delay_s)
        delay_s = min(delay_s * 2, 0.5)
    return info


async def await_rendezvous(deployment_dir: Path, timeout_s: float, *, live: bool = False) -> Rendezvous:
    """:func:`wait_rendezvous` on the running event loop.

    Not ``wait_rendezvous`` in a thread: a cancel (a SIGTERM meanwhile) ends this at once, where a thread
    would poll on and hold up the process's exit (``asyncio.run`` joins it) until ``timeout_s``.
    """
    deadline, delay_s = time.monotonic() + timeout_s, 0.02
    while (info := _read_by(deployment_dir, deadline, live)) is None:
        await asyncio.sleep(delay_s)
        delay_s = min(delay_s * 2, 0.5)
    return info


def remove_rendezvous(deployment_dir: Path, pid: int) -> None:
    """Remove the file if it is still ours (a newer broker may have replaced it)."""
    path = rendezvous_path(deployment_dir)
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        return


class BrokerLock:
    """The deployment's broker lock: one live broker per deployment folder.

    An exclusive ``flock`` on ``<deployment>/broker.lock``, held until
    :meth:`release` or the process exits (the kernel drops it then, even
    after ``kill -9``), so a second broker for a live deployment refuses to
    start instead of taking over its rendezvous file and journal.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, deployment_dir: Path) -> BrokerLock:
        """Take the lock; :class:`DeploymentBusy` naming the live broker if another process holds it."""
        deployment_dir.mkdir(parents=True, exist_ok=True)
        path = deployment_dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            os.close(fd)
            raise DeploymentBusy(
                f"deployment {deployment_dir.name!r} already has a live broker ({_describe_live(deployment_dir)}); "
                "stop it first (prorl stop) or pick another deployment (-d NAME)"
            ) from e
        except OSError:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return cls(path, fd)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> BrokerLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _describe_live(deployment_dir: Path) -> str:
    """Who holds the lock, from the rendezvous file (or the lock file while the broker is starting)."""
    try:
        info = read_rendezvous(deployment_dir)
        return f"pid {info.pid} on {info.host}, listening on {info.address}"
    except RendezvousError:
        try:
            pid = (deployment_dir / LOCK_NAME).read_text().strip()
        except OSError:
            pid = "?"
        return f"pid {pid or '?'}, still starting"
