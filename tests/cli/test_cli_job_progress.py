"""``prorl submit`` / ``results``: progress off a terminal, and the signals that come while jobs are sent.

In process, against a fake client (``connect`` replaced): the signal is sent by the fake's ``submit_specs``
itself, so it comes while the jobs go out, every time, with no timing involved.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from prorl_cli.cli import cli
from prorl_cli.cli.jobs import collect as collect_module
from prorl_cli.client.results import Submitted
from prorl_cli.protocol import JobResult


class FakeStream:
    """``client.results(ids)``: yields the fake's scripted results, one per call, then ``None`` (nothing yet)
    ``idle`` times before each."""

    def __init__(self, client: FakeClient, ids: list[str]) -> None:
        self.client = client
        self.left = list(ids)
        self.idle_left = client.idle

    def __enter__(self) -> FakeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def next_within(self, wait_s: float | None) -> JobResult | None:
        if not self.left:
            raise StopIteration
        if self.client.signum is not None and self.client.signal_in_stream:
            os.kill(os.getpid(), self.client.signum)
        if self.idle_left:
            self.idle_left -= 1
            return None
        self.idle_left = self.client.idle
        job_id = self.left.pop(0)
        return JobResult(job_id=job_id, task="t", state=self.client.state_of(job_id), reward=1.0)


class FakeClient:
    """What the job commands use of a RolloutClient; ``signum``: sent to this process from ``submit_specs``."""

    def __init__(self, signum: int | None = None, taken: int = 0, idle: int = 0) -> None:
        self.signum = signum
        #: The signal comes while results are awaited, not while jobs are sent.
        self.signal_in_stream = False
        self.taken = taken
        self.idle = idle
        self.submitted: list[str] = []
        self.cancelled: list[list[str]] = []
        self.polls = 0

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @staticmethod
    def state_of(job_id: str) -> str:
        return "failed" if job_id.endswith("-1") else "done"

    def make_specs(self, task: str, count: int, *, job_ids: list[str], **kwargs: Any) -> list[str]:
        return list(job_ids)

    def submit_specs(self, specs: list[str], instances: list[Any]) -> Submitted:
        self.submitted = list(specs)
        if self.signum is not None:
            os.kill(os.getpid(), self.signum)  # the handler runs here, in the main thread, before this returns
        return Submitted(list(specs), list(specs), [])

    def cancel(self, job_ids: list[str]) -> dict[str, str]:
        self.cancelled.append(list(job_ids))
        return {j: "cancelled" if k < self.taken else "unknown" for k, j in enumerate(job_ids)}

    def list_jobs(self, prefix: str | None = None, group_id: str | None = None) -> dict[str, str]:
        self.polls += 1
        return {j: "queued" for j in self.submitted}

    def results(self, job_ids: list[str]) -> FakeStream:
        return FakeStream(self, job_ids)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, FakeClient]]:
    holder: dict[str, FakeClient] = {"client": FakeClient()}
    monkeypatch.setattr("prorl_cli.cli.jobs.connect", lambda app, address=None: holder["client"])
    monkeypatch.setattr("prorl_cli.cli.common.connect", lambda app, address=None: holder["client"])
    # Restored after each test: a handler left behind would outlive the test.
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a signal the command does not take ends in this, not in pytest's death
        signal.signal(sig, _not_taken)
    yield holder
    for sig, handler in before.items():
        signal.signal(sig, handler)


class SignalNotTaken(RuntimeError):
    """A signal reached the handler the test put in place: the command under test did not handle it."""


def _not_taken(signum: int, frame: object) -> None:
    raise SignalNotTaken(signal.Signals(signum).name)


def run(tmp_path: Path, *args: str, rows: int = 3) -> Result:
    tasks = tmp_path / "t.jsonl"
    tasks.write_text("".join(json.dumps({"x": i}) + "\n" for i in range(rows)))
    return CliRunner().invoke(cli, ["submit", str(tasks), "--task", "t", "--id-prefix", "p", *args],
                              env={"PRORL_HOME": str(tmp_path / "home"), "PRORL_CONFIG": None})


@pytest.mark.parametrize(("signum", "code", "said"), [
    (signal.SIGTERM, 143, "terminated (SIGTERM)"),
    (signal.SIGHUP, 129, "hung up (SIGHUP)"),
    (signal.SIGINT, 130, "interrupted"),
], ids=["sigterm", "sighup", "ctrl-c"])
def test_a_signal_while_submitting_cancels_what_the_broker_took(
    fake: dict[str, FakeClient], tmp_path: Path, signum: int, code: int, said: str
) -> None:
    client = fake["client"] = FakeClient(signum, taken=2)
    r = run(tmp_path, "-n", "2")
    assert r.exit_code == code, r.output
    ids = [f"p-{row}-{k}" for row in range(3) for k in range(2)]
    assert client.cancelled == [ids]  # every id of this submission: the broker took some, the others are unknown
    assert f"{said} while submitting: cancelled 2 job(s) of 't' (ids p-LINE-K); the broker had taken 2 of 6" in r.stderr
    assert r.stderr.rstrip().splitlines()[-1].startswith("error: ")


def test_a_signal_while_submitting_with_detach_leaves_the_jobs_and_says_how_to_go_on(
    fake: dict[str, FakeClient], tmp_path: Path
) -> None:
    client = fake["client"] = FakeClient(signal.SIGTERM, taken=2)
    r = run(tmp_path, "--detach")
    assert r.exit_code == 143, r.output
    assert client.cancelled == []
    assert "terminated (SIGTERM) while submitting" in r.stderr and "--id-prefix p sends the rest" in r.stderr
    assert "cancel" in r.stderr and "--prefix p" in r.stderr


def test_nohup_keeps_sighup_ignored(fake: dict[str, FakeClient]) -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with collect_module.InterruptSignals():
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


def test_submit_off_a_terminal_prints_plain_progress_lines(fake: dict[str, FakeClient], tmp_path: Path) -> None:
    client = fake["client"] = FakeClient()
    r = run(tmp_path, "-n", "2", rows=10)  # 20 jobs: a line each 10 % (2 jobs), besides the first
    assert r.exit_code == 0, r.output
    lines = [line for line in r.stderr.splitlines() if line.startswith("t: ")]
    assert lines[0].startswith("t: 0/20 ended; running 0, queued 20"), r.stderr
    assert lines[-1].startswith("t: 20/20 ended (done 10, failed 10)"), r.stderr
    assert len(lines) == 11, r.stderr
    assert "t: 10/20 ended (done 5, failed 5); running 0, queued 10" in r.stderr  # from the broker's states
    assert "\x1b" not in r.stderr and "━" not in r.stderr
    assert client.polls >= 1


def test_progress_off_a_terminal_goes_on_while_no_job_ends(
    fake: dict[str, FakeClient], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line is due once the last is PROGRESS_EVERY_S old, whether or not a job ended: 0 makes every wait one."""
    monkeypatch.setattr(collect_module, "PROGRESS_EVERY_S", 0.0)
    fake["client"] = FakeClient(idle=2)
    r = run(tmp_path, rows=1)
    assert r.exit_code == 0, r.output
    waiting = [line for line in r.stderr.splitlines() if line.startswith("t: 0/1 ended")]
    assert len(waiting) == 3, r.stderr  # the first line, then one per wait without a result


def test_a_signal_on_results_leaves_the_jobs_running_and_ends_with_its_code(
    fake: dict[str, FakeClient], tmp_path: Path
) -> None:
    client = fake["client"] = FakeClient(signal.SIGHUP)
    client.signal_in_stream = True
    client.submitted = ["p-0-0", "p-1-0"]
    r = CliRunner().invoke(cli, ["results", "--prefix", "p", "--follow"],
                           env={"PRORL_HOME": str(tmp_path / "home"), "PRORL_CONFIG": None})
    assert r.exit_code == 129, r.output
    assert client.cancelled == []
    assert "hung up (SIGHUP): 2 job(s) still running" in r.stderr and "--prefix p --follow" in r.stderr
    assert r.stderr.rstrip().splitlines()[-1] == "error: hung up (SIGHUP)"


def test_the_rate_counts_the_jobs_that_end_while_the_command_watches() -> None:
    """Results collected after their jobs ended arrive at once: counted in the rate, ``prorl results`` showed
    thousands of jobs/s. Jobs the first poll finds ended are left out of it; a selection all ended has no rate."""
    ids = [f"j{i}" for i in range(4)]
    tally = collect_module.Tally(len(ids))
    tally.polled({"j0": "done", "j1": "failed", "j2": "running", "j3": "queued"}, ids)
    tally.started_s -= 10.0  # as if it had watched for 10 s
    for job_id, state in (("j0", "done"), ("j1", "failed")):
        tally.add(JobResult(job_id=job_id, task="t", state=state))
    assert tally.text().endswith("; 0.0 jobs/s"), tally.text()
    tally.add(JobResult(job_id="j2", task="t", state="done"))
    assert "; 0.1 jobs/s" in tally.text(), tally.text()
    ended = collect_module.Tally(2)
    ended.polled({"j0": "done", "j1": "cancelled"}, ["j0", "j1"])
    assert "jobs/s" not in ended.text()
