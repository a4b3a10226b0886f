"""What several commands share: connecting to a deployment, reading TASKS files, the sampling options."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import shlex
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from prorl_cli.cli.application import App

if TYPE_CHECKING:
    from prorl_cli.client import RolloutClient
    from prorl_cli.rendezvous import Rendezvous

F = TypeVar("F", bound=Callable[..., Any])


#: How long a command waits for the broker's ping before saying it does not answer.
PING_TIMEOUT_S = 3.0
#: How much longer it waits for a broker whose process is alive on this host: a machine whose cores something
#: else holds (vLLM on the CPU, a build) can keep a healthy broker from answering for several seconds.
BUSY_BROKER_WAIT_S = 30.0


class Seconds(click.ParamType):
    """A finite number of seconds, at least 0: nan, inf and negatives are refused (a wait for nan seconds never ends)."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds) or seconds < 0:
            self.fail(f"{value!r} is not a finite number of seconds >= 0", param, ctx)
        return seconds


def command_hint(app: App, command: str, *args: str | Path, address: str | None = None,
                 deployment: str | None = None, home: str | Path | None = None, named: bool = True) -> str:
    """A prorl command line to paste that acts where this one did: ``prorl [--home DIR] COMMAND -d NAME ARGS``
    (``--address ENDPOINT`` last where given), every word shell-quoted (a path or URL with a space or ``&`` stays
    one argument). Every printed hint is made here, so none forgets the deployment.

    ``command`` is the subcommand's words (``"backends clear"``); ``args`` its arguments (placeholders such as
    ``FILE`` stay as they are). The deployment is ``deployment``, else this command's (``app.config``): named
    always, since the shell it is pasted in may have another ``$PRORL_DEPLOYMENT`` or prorl.yaml; ``named``
    False leaves it out (a command that takes none). The home is ``home``, else the ``--home`` this command was
    given (absolute: the hint may be pasted in another folder); one from ``$PRORL_HOME`` is the shell's own.
    """
    words = ["prorl"]
    given = app.overrides.get("home")
    if home is None and given is not None:
        home = os.path.abspath(os.path.expanduser(os.path.expandvars(str(given))))  # as ProrlConfig.home_path reads it
    if home is not None:
        words += ["--home", str(home)]
    words += command.split()
    if named:
        words += ["-d", deployment if deployment is not None else app.config.deployment]
    words += [str(a) for a in args]
    if address is not None:
        words += ["--address", address]
    return shlex.join(words)


def connect(app: App, address: str | None = None) -> RolloutClient:
    """A client for the deployment whose broker answered a short ping; a one-line error if it is not there."""
    from prorl_cli.client import RolloutClient
    from prorl_cli.exceptions import (
        BadAddress,
        BrokerRefused,
        BrokerUnavailable,
        ProtocolMismatch,
        RendezvousError,
    )

    client = RolloutClient(app.config.deployment, address=address, config=app.config)
    try:
        ping_broker(app, client, address)
    except BadAddress as e:  # an endpoint ZeroMQ cannot connect to (no tcp://, no port)
        client.close()
        app.abort(f"--address {address}: {e}" if address is not None else str(e))
    except (BrokerRefused, ProtocolMismatch) as e:  # it answered, and the error says what is wrong and what to do
        client.close()
        app.abort(str(e))
    except (RendezvousError, BrokerUnavailable) as e:  # not there, or silent: a Slurm launch's may be on its way back
        client.close()
        restarting = _broker_restarting(app) if address is None else None
        if restarting is None:
            _abort_unreachable(app, e, address)
        return _wait_for_broker(app, restarting)
    return client


def ping_broker(app: App, client: RolloutClient, address: str | None = None) -> None:
    """Ping the deployment's broker; the client's errors propagate. One silent for :data:`PING_TIMEOUT_S` whose
    process is alive on this host is busy, not gone: stderr says so and it gets :data:`BUSY_BROKER_WAIT_S` more,
    after which :class:`BrokerBusy` says it is stuck or starved."""
    from prorl_cli.exceptions import BrokerBusy, BrokerUnavailable

    try:
        client.ping(timeout_s=PING_TIMEOUT_S)
        return
    except BrokerUnavailable:
        pid = _live_local_broker(app) if address is None else None
        if pid is None:
            raise
    app.err_console.print(f"the broker (pid {pid} on this host) is running but has not answered within "
                          f"{PING_TIMEOUT_S:g} s; waiting up to {BUSY_BROKER_WAIT_S:g} s more", markup=False,
                          soft_wrap=True, highlight=False)
    try:
        client.ping(timeout_s=BUSY_BROKER_WAIT_S)
    except BrokerUnavailable as e:
        waited_s = PING_TIMEOUT_S + BUSY_BROKER_WAIT_S
        raise BrokerBusy(f"the broker at {client.address} does not answer (deployment {app.config.deployment!r}, "
                         f"no reply within {waited_s:g} s); its process (pid {pid} on this host) is running: stuck, "
                         f"or starved of CPU (`top -p {pid}` shows which); its log says what it last did",
                         pid, waited_s) from e


def _live_local_broker(app: App) -> int | None:
    """The pid of the deployment's broker when its rendezvous file names a live broker process on this host."""
    from prorl_cli.exceptions import RendezvousError
    from prorl_cli.rendezvous import read_rendezvous

    try:
        info = read_rendezvous(app.config.deployment_dir)
    except RendezvousError:
        return None
    return info.pid if info.process_alive() else None


#: How long a command waits for the broker of a Slurm launch that is restarting (requeued on its time limit,
#: replaced after a crash): Slurm's requeue and the journal's replay take a minute or two.
BROKER_RESTART_WAIT_S = 300.0
#: How often it asks again meanwhile.
BROKER_RESTART_POLL_S = 2.0


def _abort_unreachable(app: App, e: Exception, address: str | None) -> NoReturn:
    """The one-line error of a broker that has no rendezvous file or does not answer."""
    from prorl_cli.exceptions import BrokerBusy, RendezvousError
    from prorl_cli.rendezvous import read_rendezvous

    if isinstance(e, RendezvousError | BrokerBusy):
        app.abort(str(e))
    info = None
    if address is None:
        with contextlib.suppress(RendezvousError):
            info = read_rendezvous(app.config.deployment_dir)
    app.abort(
        f"the broker at {address or (info.address if info is not None else '?')} does not answer (deployment "
        f"{app.config.deployment!r}, no reply within {PING_TIMEOUT_S:g} s); {_why_silent(app, info)}"
    )


def _broker_restarting(app: App) -> str | None:
    """Slurm's words for a launched deployment's broker that is on its way back (its job requeued or replaced),
    else None (not a Slurm launch, taken down, or its broker gone for good)."""
    from prorl_cli.slurm.record import LaunchRecord

    if LaunchRecord.load(app.config.deployment_dir) is None:
        return None  # not launched on Slurm: nothing brings a broker back by itself
    from prorl_cli.cli.launch import slurm_view

    view = slurm_view(app, app.config.deployment_dir)
    if view is None or view.rows is None or view.taken_down is not None or view.record.stopping:
        return None
    return view.broker_restarting()


def _wait_for_broker(app: App, restarting: str) -> RolloutClient:
    """A client of the broker of a Slurm launch that is restarting, once it answers: a submission made while it
    moves (a time limit's requeue, a replacement after a crash) waits for it instead of failing; Ctrl-C stops
    waiting. Gives up, naming ``prorl status``, once nothing brings it back or after :data:`BROKER_RESTART_WAIT_S`."""
    import time

    from prorl_cli.client import RolloutClient
    from prorl_cli.exceptions import BrokerUnavailable, RendezvousError

    app.err_console.print(f"the broker of {app.config.deployment!r} is restarting ({restarting}); waiting up to "
                          f"{BROKER_RESTART_WAIT_S:g} s for it", markup=False, soft_wrap=True, highlight=False)
    deadline = time.monotonic() + BROKER_RESTART_WAIT_S
    status = command_hint(app, "status")
    while True:
        client = RolloutClient(app.config.deployment, config=app.config)
        try:
            ping_broker(app, client)
        except (RendezvousError, BrokerUnavailable):
            client.close()
        else:
            app.err_console.print(f"the broker of {app.config.deployment!r} is back", markup=False, highlight=False)
            return client
        if time.monotonic() >= deadline:
            app.abort(f"the broker of {app.config.deployment!r} did not come back within {BROKER_RESTART_WAIT_S:g} s; "
                      f"`{status}` says where it is")
        if _broker_restarting(app) is None:
            app.abort(f"the broker of {app.config.deployment!r} is not coming back (its Slurm job ended for good); "
                      f"`{status}` says what happened")
        time.sleep(BROKER_RESTART_POLL_S)


def _why_silent(app: App, info: Rendezvous | None) -> str:
    """What the rendezvous file (``info``; None: none read, or ``--address`` given) tells of a broker that does
    not answer."""
    if info is None or not info.process_gone():
        return "is it running?"
    return (f"its process (pid {info.pid} on this host) is gone, killed without cleaning up: "
            f"`{command_hint(app, 'serve broker')}` starts it again (its journal keeps the jobs it had), or "
            f"`{command_hint(app, 'stop')}` stops the deployment, nodes included")


def read_instances(app: App, path: Path) -> list[Any]:
    """One JSON value per line; blank lines skipped; errors name the line."""
    from prorl_cli.exceptions import DatasetError
    from prorl_cli.jsonl import jsonl_values

    try:
        return [value for _, value in jsonl_values(path, DatasetError, hint="TASKS is JSONL: one JSON instance per line")]
    except DatasetError as e:
        app.abort(str(e))
    except OSError as e:
        app.abort(f"{path}: cannot read: {e.strerror or e}")


def warning_printer(app: App) -> Callable[[str], None]:
    """What a dataset loader's ``warn`` lines go to: stderr, each as ``warning: LINE``."""
    from rich.markup import escape

    return lambda line: app.err_console.print(f"[yellow]warning:[/] {escape(line)}", soft_wrap=True)


def load_task_file(app: App, task: str, path: Path, fmt: str | None, skip_bad_rows: bool = False) -> list[Any]:
    """TASKS for ``task``: domain rows through their loaders, others as JSON lines (or Parquet rows).

    ``skip_bad_rows`` (``--skip-bad-rows``): domain rows that cannot be loaded are left out, and stderr says
    how many and why (the first few, each with its file, line and field).
    """
    return [instance for _, instance in load_task_rows(app, task, path, fmt, skip_bad_rows)]


def load_task_rows(app: App, task: str, path: Path, fmt: str | None, skip_bad_rows: bool = False) -> list[tuple[int, Any]]:
    """:func:`load_task_file`'s instances with their row in the file (from 0, rows left out counted)."""
    from prorl_cli.domains.datasets import LOADERS, load_rows
    from prorl_cli.exceptions import DatasetError

    if task not in LOADERS and fmt is None and not skip_bad_rows and path.suffix != ".parquet":
        return list(enumerate(read_instances(app, path)))
    try:
        return load_rows(task, path, fmt, skip_bad_rows=skip_bad_rows, warn=warning_printer(app))
    except DatasetError as e:
        app.abort(str(e))
    except UnicodeDecodeError as e:
        app.abort(f"{path}: not a UTF-8 text file: {e.reason} at byte {e.start}")
    except OSError as e:
        app.abort(f"{path}: cannot read: {e.strerror or e}")


def dataset_errors() -> tuple[type[Exception], ...]:
    """What reading a dataset file (JSONL, JSON or Parquet) raises when the file is bad: the loaders' DatasetError
    (a .parquet that is not one included), the OS's and a non-UTF-8 file's."""
    from prorl_cli.exceptions import DatasetError

    return (DatasetError, OSError, UnicodeDecodeError)


def check_out_path(app: App, out: Path, option: str = "--out", tasks_file: Path | None = None) -> None:
    """Refuse an output file (``option``) that cannot be written, before anything is submitted or computed; and
    one that is ``tasks_file`` itself (the results would overwrite the rows they are made of)."""
    parent = out.parent
    if not parent.is_dir():
        app.abort(f"{option} {out}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        app.abort(f"{option} {out}: folder {parent} is not writable")
    if out.is_dir():
        app.abort(f"{option} {out}: is a folder")
    if tasks_file is not None and out.exists() and out.samefile(tasks_file):
        app.abort(f"{option} {out}: that is the TASKS file: the results would overwrite its rows; name another file")
    if out.suffix == ".parquet" and importlib.util.find_spec("pyarrow") is None:
        # Said now: at the end, every rollout would have run for a file that cannot be written.
        app.abort(f"{option} {out}: Parquet export needs pyarrow, which is not installed here: "
                  "pip install 'prorl[parquet]', or write .jsonl")


def sampling_from_options(
    app: App, sampling_json: str | None, sampling_file: Path | None, flags: dict[str, Any],
) -> dict[str, Any] | None:
    """The ``sampling`` of every job: ``--sampling`` JSON or ``--sampling-file``, then the single flags on top.

    Checked against the generate contract's SamplingParams here, so a typo is
    refused before anything is submitted, naming the option and the field.
    """
    from prorl_cli.exceptions import ProtocolError
    from prorl_cli.protocol import SAMPLING

    if sampling_json is not None and sampling_file is not None:
        app.abort("give --sampling or --sampling-file, not both")
    base: Any = None
    source = ""
    if sampling_json is not None:
        source = "--sampling"
        try:
            base = json.loads(sampling_json)
        except json.JSONDecodeError as e:
            app.abort(f"--sampling: not valid JSON ({e.msg} at character {e.pos}); e.g. '{{\"max_tokens\": 64, \"temperature\": 0.7}}'")
    elif sampling_file is not None:
        import yaml

        from prorl_cli import yamlfiles

        source = f"--sampling-file {sampling_file}"
        try:
            base = yamlfiles.load(sampling_file.read_text(encoding="utf-8"))  # YAML is a superset of JSON
        except (OSError, UnicodeDecodeError) as e:
            app.abort(f"{source}: cannot read: {getattr(e, 'strerror', None) or e}")
        except yaml.YAMLError as e:
            app.abort(f"{source}: not valid YAML or JSON: {str(e).splitlines()[0]}")
    if base is not None and not isinstance(base, dict):
        app.abort(f"{source}: must be a JSON object of sampling fields (max_tokens, temperature, top_p, top_k, seed, "
                  f"stop_token_ids, ignore_eos), got {type(base).__name__}")
    sampling = {**(base or {}), **{k: v for k, v in flags.items() if v is not None}}
    if not sampling:
        return None
    try:
        SAMPLING(sampling, "sampling")
    except ProtocolError as e:
        app.abort(f"{source or 'sampling'}: {e.message}")
    return sampling


def sampling_options(fn: F) -> F:
    """The TASKS ``--format`` and ``--skip-bad-rows`` and the sampling options every job of a command gets
    (``submit``, ``sample``)."""
    options = [
        click.option("--format", "fmt", metavar="FORMAT",
                     help="Row shape of TASKS for the domain tasks (math, code, swe, search) where it is ambiguous, "
                          "e.g. code: io, test_cases, apps, livecodebench, codecontests, codeforces, verl, verification_info; swe: a source's name "
                          "(docs/domains.md)."),
        click.option("--skip-bad-rows", is_flag=True,
                     help="Domain tasks: leave out the rows of TASKS that cannot be loaded (a field missing or unusable, "
                          "a line that is not JSON) instead of stopping at the first; stderr says how many, with the "
                          "first reasons (file, line, field). A file of bad rows only is still an error."),
        click.option("--max-tokens", type=click.IntRange(min=1), help="Sampling: most tokens per generate call."),
        click.option("--temperature", type=click.FloatRange(min=0), help="Sampling: temperature (0 is greedy)."),
        click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True),
                     help="Sampling: nucleus mass, in (0, 1]."),
        click.option("--seed", type=int,
                     help="Sampling: the run's seed; each rollout gets its own, derived from it and the rollout's "
                          "index (a row's rollouts differ), and a rerun repeats them where the engine honours seeds."),
        click.option("--sampling", "sampling_json", metavar="JSON",
                     help='Sampling of every job as a JSON object of SamplingParams fields, e.g. '
                          '\'{"max_tokens": 64, "top_k": 20}\' (docs/protocol.md); the single options above override '
                          "its keys."),
        click.option("--sampling-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="The same object read from a JSON or YAML file."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def sampling_of(app: App, max_tokens: int | None, temperature: float | None, top_p: float | None, seed: int | None,
                sampling_json: str | None, sampling_file: Path | None) -> dict[str, Any] | None:
    """The checked sampling of :func:`sampling_options`' values (None when nothing was given)."""
    return sampling_from_options(app, sampling_json, sampling_file,
                                 {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed})


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, unwinding as Ctrl-C does (:class:`InterruptSignals`); the CLI says which it was."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signal.Signals(signum)
        super().__init__(self.signum.name)


def signal_words(signum: int) -> str:
    """What a signal that stops a command is called where the command says so: ``terminated (SIGTERM)``."""
    sig = signal.Signals(signum)
    return f"{'hung up' if sig == signal.SIGHUP else 'terminated'} ({sig.name})"


def interruption(e: KeyboardInterrupt) -> tuple[str, int]:
    """How to name an interruption and the exit code to end with: the shell's 128 + the signal (SIGTERM 143,
    SIGHUP 129), Ctrl-C's 130."""
    if isinstance(e, Terminated):
        return signal_words(e.signum), 128 + e.signum.value
    return "interrupted (Ctrl-C)", 130


class InterruptSignals:
    """While entered, SIGTERM and SIGHUP unwind like Ctrl-C (a :class:`Terminated`, a ``KeyboardInterrupt``), so a
    command cleans up as it does on Ctrl-C: a Slurm job cancelled, preempted or out of time gets SIGTERM, a
    dropped ssh session or closed terminal SIGHUP, and jobs nobody will collect must not stay queued (nor a
    build's temp files stay behind). ``signum``: the signal that came (``None``: none, or Ctrl-C).

    A signal ignored when entered stays ignored (``nohup prorl ...`` outlives its terminal, as asked), and one
    whose handler was set outside Python is left alone. Once one came, further ones are ignored until :meth:`restore` (after
    the clean-up; leaving the block restores only when none came): a terminal's hangup comes to the whole
    process group, often twice, and a second signal would cut the clean-up short.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.signum: signal.Signals | None = None
        self._before: dict[signal.Signals, Any] = {}

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            return  # the first one is being handled: its clean-up must not be cut short
        self.signum = signal.Signals(signum)
        raise Terminated(self.signum)

    def __enter__(self) -> InterruptSignals:
        import threading

        if threading.current_thread() is threading.main_thread():  # signal handlers are the main thread's
            for sig in self.SIGNALS:
                before = signal.getsignal(sig)
                if before is not None and before != signal.SIG_IGN:
                    self._before[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.signum is None:
            self.restore()

    def restore(self) -> None:
        """Put the handlers back (a signal from now on does what it did before)."""
        for sig, before in self._before.items():
            signal.signal(sig, before)
        self._before.clear()

    @property
    def how(self) -> str:
        """The words for what stopped the command: ``interrupted``, ``terminated (SIGTERM)``, ``hung up (SIGHUP)``."""
        return "interrupted" if self.signum is None else signal_words(self.signum)


@contextmanager
def interrupt_signals() -> Iterator[InterruptSignals]:
    """:class:`InterruptSignals` for a command whose clean-up runs inside the block: Ctrl-C, SIGTERM and SIGHUP end
    it once its clean-up ran (the ``prorl`` group then says which, exit 130, 143 or 129); signals that come during
    that clean-up are ignored, and the handlers are put back when the block is left."""
    signals = InterruptSignals()
    try:
        with signals:
            yield signals
    finally:
        signals.restore()
