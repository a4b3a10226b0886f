"""The node's record of the sandboxes it started, and reaping a crashed predecessor's.

One JSON file per live sandbox under ``<state_dir>/sandboxes/``, written
before its session folder is made (with no process yet), completed as soon as
its process exists, and removed when it is stopped: a node killed at any
point leaves a record for whatever it left. A node server
that starts in the same run directory kills what the files name, after
checking each process's identity (boot id, pid and start time): it never
kills a process it did not start. A node server under any other id reaps the
records in its siblings' run directories whose owner (the node process,
identified by pid and start time) is dead on this machine, when it starts and
again when it stops.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prorl_cli.sandbox.cgroups import remove_paths
from prorl_cli.sandbox.runtime import (
    kill_session,
    proc_start_ticks,
    process_tree,
    remove_tree,
    session_members,
    stat_fields,
    wait_gone,
)

REAP_WAIT_S = 30.0


def boot_id() -> str:
    """This boot's id: start times are only comparable within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except FileNotFoundError:
        return "unknown"


@dataclass
class SandboxRecord:
    """What identifies a started sandbox's processes and files."""

    sandbox_id: str
    job_id: str
    runtime: str
    pid: int | None  # None while starting: the session folder may exist, no process yet
    pgid: int | None
    start_ticks: int | None
    boot_id: str
    session_dir: str
    #: The node process that started it (pid, start time); ``None`` in records of older nodes.
    owner_pid: int | None = None
    owner_start_ticks: int | None = None
    #: Its cgroup directories (``prorl-sandbox-<id>``), where the node made any.
    cgroups: list[str] = field(default_factory=list)

    def owner_dead(self, current_boot: str) -> bool:
        """Whether the node that recorded this sandbox is known to be dead on this machine."""
        if self.owner_pid is None or self.boot_id != current_boot:
            return False  # an old record, or another machine's (a shared file system): not ours to judge
        fields = stat_fields(self.owner_pid)
        # A zombie is dead too (an init that does not reap leaves the killed node as one).
        return fields is None or fields[0] in ("Z", "X") or int(fields[19]) != self.owner_start_ticks


class RecordStore:
    """The records directory of one node."""

    def __init__(self, directory: Path, log: logging.Logger) -> None:
        self.directory = directory
        self.log = log

    def _path(self, sandbox_id: str) -> Path:
        return self.directory / f"{sandbox_id}.json"

    def write(self, record: SandboxRecord) -> None:
        """Record a sandbox (atomically: a crash never leaves half a file)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self._path(record.sandbox_id).with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(record)))
        os.replace(tmp, self._path(record.sandbox_id))

    def remove(self, sandbox_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(sandbox_id).unlink()

    def load_all(self) -> list[SandboxRecord]:
        """Every readable record; unreadable files are logged and removed."""
        records: list[SandboxRecord] = []
        if not self.directory.is_dir():
            return records
        for path in sorted(self.directory.glob("*.json")):
            try:
                records.append(SandboxRecord(**json.loads(path.read_text())))
            except FileNotFoundError:
                continue  # another node reaped it meanwhile (nodes leaving together reap the same dead sibling)
            except (ValueError, TypeError) as e:
                self.log.warning("ignoring unreadable sandbox record %s: %s", path, e)
                path.unlink(missing_ok=True)
        return records

    def reap(self) -> int:
        """Kill and clean up every recorded sandbox still running; return how many were."""
        killed = 0
        current_boot = boot_id()
        for rec in self.load_all():
            alive = self._kill_if_ours(rec, current_boot)
            killed += alive
            self._remove_cgroups(rec)
            remove_tree(Path(rec.session_dir), self.log)
            self.remove(rec.sandbox_id)
            self.log.info(
                "reaped sandbox %s of job %s from a previous node server (%s)",
                rec.sandbox_id, rec.job_id, "killed its processes" if alive else "already gone",
            )
        return killed

    def reap_orphans(self, nodes_dir: Path) -> int:
        """Reap the records of dead nodes in the other run dirs under ``nodes_dir``; return how many still ran."""
        killed = 0
        current_boot = boot_id()
        for directory in sorted(nodes_dir.glob("*/sandboxes")):
            if directory.resolve() == self.directory.resolve():
                continue
            other = RecordStore(directory, self.log)
            for rec in other.load_all():
                if not rec.owner_dead(current_boot):
                    continue
                alive = self._kill_if_ours(rec, current_boot)
                killed += alive
                self._remove_cgroups(rec)
                remove_tree(Path(rec.session_dir), self.log)
                other.remove(rec.sandbox_id)
                self.log.info("reaped sandbox %s of job %s left by dead node process %s (%s)", rec.sandbox_id,
                              rec.job_id, rec.owner_pid, "killed its processes" if alive else "already gone")
        return killed

    def _remove_cgroups(self, rec: SandboxRecord) -> None:
        """Empty and remove a dead node's sandbox cgroups (anything in them is that sandbox's)."""
        if rec.cgroups and rec.boot_id == boot_id():
            for path in remove_paths(rec.cgroups):
                self.log.warning("sandbox %s: could not remove its cgroup %s", rec.sandbox_id, path)

    def _kill_if_ours(self, rec: SandboxRecord, current_boot: str) -> bool:
        if rec.boot_id != current_boot or rec.pid is None or rec.pgid is None:
            return False  # the machine rebooted (those processes are long gone), or it died before one started
        ticks = proc_start_ticks(rec.pid)
        if ticks is None:
            # The leader is gone (with a PID namespace, so is everything
            # inside). Members left in its session cannot be proven ours
            # without it: report them, kill nothing.
            strays = session_members(rec.pid)
            if strays:
                self.log.warning("sandbox %s: leader %d is gone but processes %s remain in its session; "
                                 "not killing what cannot be identified", rec.sandbox_id, rec.pid, strays)
            return False
        if ticks != rec.start_ticks:
            # The pid now belongs to another process: not ours, leave it alone.
            self.log.info("sandbox %s: pid %d was reused by another process; not killing", rec.sandbox_id, rec.pid)
            return False
        # Our leader, identified by pid and start time: kill its whole group
        # and wait until it and everything below it are gone.
        tree = set(process_tree(rec.pid)) | set(session_members(rec.pid))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rec.pgid, signal.SIGKILL)
        tree |= set(kill_session(rec.pid))
        left = wait_gone(sorted(tree), REAP_WAIT_S)
        if left:
            self.log.warning("sandbox %s: processes %s still running %.0f s after SIGKILL",
                             rec.sandbox_id, left, REAP_WAIT_S)
        return True
