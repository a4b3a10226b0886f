"""Logging: JSON lines on request (``PRORL_LOG_FORMAT=json``), per-job log files, rate-limited peer warnings."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

#: ``PRORL_LOG_FORMAT=json``: every prorl process logs one JSON object per line.
ENV_LOG_FORMAT = "PRORL_LOG_FORMAT"
#: The levels ``log_level`` in prorl.yaml, ``$PRORL_LOG_LEVEL`` and ``--log-level`` accept (any case; the config
#: keeps them upper-case). Here, not in :mod:`prorl_cli.config`, so the CLI names them without importing the config.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Other names :mod:`logging` has for those levels, taken as the level they name (``PRORL_LOG_LEVEL=WARN`` worked
#: before the name was checked, and exported in a shell or a Slurm script it must go on working).
LOG_LEVEL_ALIASES = {"WARN": "WARNING", "FATAL": "CRITICAL"}


def log_level_name(given: str) -> str | None:
    """The :data:`LOG_LEVELS` name ``given`` (any case, or an alias) stands for, else ``None``."""
    name = given.strip().upper()
    name = LOG_LEVEL_ALIASES.get(name, name)
    return name if name in LOG_LEVELS else None

_STANDARD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (epoch s), level, logger, process role and pid, message, extras."""

    def __init__(self, role: str = "") -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "role": self.role,
            "pid": record.process,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        for k, v in record.__dict__.items():
            if k not in _STANDARD_ATTRS and not k.startswith("_"):
                out[k] = v if isinstance(v, str | int | float | bool | type(None)) else repr(v)
        return json.dumps(out)


def json_logs_wanted() -> bool:
    return os.environ.get(ENV_LOG_FORMAT, "").strip().lower() == "json"


def formatter_for(role: str, text_format: str) -> logging.Formatter:
    """The formatter every handler of a prorl process uses: JSON lines when asked, else ``text_format``."""
    return JsonFormatter(role) if json_logs_wanted() else logging.Formatter(text_format)


class OncePerPeer:
    """Log a warning about a peer at most once per ``interval_s``, counting what was held back meanwhile."""

    #: Past this many remembered peers, those not heard of for an interval are forgotten.
    MAX_PEERS = 10_000

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[bytes, list[float]] = {}  # peer -> [last logged at, held back since]

    def warn(self, peer: bytes, name: str, message: str) -> bool:
        """Log ``message`` about ``peer`` (shown as ``name``) unless it was logged less than an interval ago."""
        now = time.monotonic()
        entry = self._last.get(peer)
        if entry is not None and now - entry[0] < self.interval_s:
            entry[1] += 1
            return False
        held = int(entry[1]) if entry is not None else 0
        if len(self._last) >= self.MAX_PEERS:
            self._last = {p: e for p, e in self._last.items() if now - e[0] < self.interval_s}
        self._last[peer] = [now, 0]
        self.logger.warning("rejected a message from peer %s: %s%s", name, message,
                            f" ({held} more rejected from it since the last report)" if held else "")
        return True


class JobLogger(logging.Logger):
    """The logger of one job: its records go to the job's own file (``RUN_DIR/job.log``, created on the first
    record, so a job that logs nothing leaves none) and on to the node's log through ``parent`` (``prorl.job.TASK``).

    Made for every job, so it is cheap: no handler object, no registration with the logging manager.
    """

    def __init__(self, name: str, parent: logging.Logger, run_dir: Path, formatter: logging.Formatter) -> None:
        super().__init__(name)
        self.parent = parent
        self._run_dir = run_dir
        self._formatter = formatter
        self._stream: Any = None

    @property
    def path(self) -> Path:
        return self._run_dir / "job.log"

    def getEffectiveLevel(self) -> int:
        return self.parent.getEffectiveLevel() if self.parent is not None else logging.INFO

    def isEnabledFor(self, level: int) -> bool:
        return level >= self.getEffectiveLevel()

    def callHandlers(self, record: logging.LogRecord) -> None:
        self._write(record)
        super().callHandlers(record)

    def _write(self, record: logging.LogRecord) -> None:
        try:
            if self._stream is None:
                self._run_dir.mkdir(parents=True, exist_ok=True)
                self._stream = self.path.open("a", encoding="utf-8")
            self._stream.write(self._formatter.format(record) + "\n")
            self._stream.flush()
        except OSError as e:
            logging.getLogger(__name__).warning("cannot write the log of %s: %s", self.name, e)

    def note(self, level: int, msg: str, *args: Any) -> None:
        """Write to the job's own file only (what the node's log already says another way)."""
        if self.isEnabledFor(level):
            self._write(self.makeRecord(self.name, level, "(job)", 0, msg, args, None))

    def close(self) -> str | None:
        """Close the file; its path if anything was written, else ``None``."""
        if self._stream is None:
            return None
        self._stream.close()
        self._stream = None
        return str(self.path)


def configure_logging(role: str, level: str) -> None:
    """Log to stderr as ``TIME ROLE[PID] LEVEL LOGGER: MESSAGE``, or as JSON lines under ``PRORL_LOG_FORMAT=json``."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter_for(role, f"%(asctime)s {role}[{os.getpid()}] %(levelname)s %(name)s: %(message)s"))
    # The name itself: the config checked it against LOG_LEVELS, and any other is logging's ValueError, never a
    # silent INFO.
    logging.basicConfig(level=log_level_name(level) or level.upper(), handlers=[handler])
