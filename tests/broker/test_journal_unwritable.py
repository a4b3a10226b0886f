"""A broker whose journal cannot be written (a full disk): real broker, node and client processes.

The broker process is given a file-size limit just above its journal's size (``RLIMIT_FSIZE``: writes past it fail
with EFBIG, as a full disk fails them with ENOSPC), then the limit is lifted, as freeing space would.
"""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prorl_cli.exceptions import JournalUnwritable
from prorl_cli.testing.harness import Deployment, fixed_port


def test_a_submit_the_journal_cannot_take_is_refused_whole_and_the_broker_goes_on(tmp_path: Path) -> None:
    config = {"broker": {"port": fixed_port(), "journal": True}}
    with Deployment(tmp_path / "home", "full", config=config) as d:
        broker = d.start_broker()
        d.start_node("n1")
        client = d.client
        first = client.submit("test", [{"echo": "before"}])
        assert client.wait(first, timeout_s=60)[0].ok
        journal = d.deployment_dir / "broker.journal"
        limits = resource.prlimit(broker.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(broker.pid, resource.RLIMIT_FSIZE, (journal.stat().st_size + 512, limits[1]))
        ids = [f"full-{i}" for i in range(50)]
        with pytest.raises(JournalUnwritable, match="cannot write.*submit it again"):
            client.submit("test", [{"echo": i, "pad": "x" * 200} for i in range(50)], job_ids=ids)
        # Still serving: status, the results it holds, and nothing of the refused submit.
        assert broker.poll() is None
        assert client.result(first[0], timeout_s=30).output["echo"] == "before"
        assert not client.list_jobs(prefix="full-")
        with pytest.raises(JournalUnwritable):  # a second try, the disk still full: refused, said once
            client.submit("test", [{"echo": i, "pad": "x" * 200} for i in range(50)], job_ids=ids)
        assert d.log("broker").count("new jobs are refused") == 1
        # The operator's status says so, with why, until the disk takes records again.
        assert "File too large" in (client.status().journal_error or "")
        shown = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", "full", "status"], env=d.env(),
                               capture_output=True, text=True, timeout=120)
        assert "SUBMITS REFUSED: the journal cannot be written" in shown.stdout, shown.stdout
        assert "written again" not in d.log("broker"), "a refused submit left nothing to write: no recovery to tell"
        # prorl submit says how to send it again without running twice what a broker may hold of it.
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text("".join(f'{{"echo": {i}, "pad": "{"x" * 200}"}}\n' for i in range(50)))
        cli = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", "full", "submit", str(tasks), "--task", "test"],
                             env=d.env(), capture_output=True, text=True, timeout=120)
        assert cli.returncode == 1 and "cannot write" in cli.stderr and "--id-prefix sub-" in cli.stderr, cli.stderr
        # Room again: the same submit is accepted, runs, and is journaled (it survives a crash of the broker).
        resource.prlimit(broker.pid, resource.RLIMIT_FSIZE, limits)
        assert client.submit("test", [{"echo": i} for i in range(50)], job_ids=ids).accepted == ids
        assert client.status().journal_error is None
        assert [r.output["echo"] for r in client.wait(ids, timeout_s=120)] == list(range(50))
        d.kill("broker", signal.SIGKILL)
        d.start_broker()
        fresh = d.new_client()
        assert fresh.result(ids[-1], timeout_s=30).output["echo"] == 49
        fresh.close()


def test_a_broker_stopped_while_its_journal_cannot_be_written_stops_cleanly(tmp_path: Path) -> None:
    """A clean stop removes the journal: what could not be written is not needed, and it raised out of the stop."""
    with Deployment(tmp_path / "home", "fullstop", config={"broker": {"journal": True}}) as d:
        broker = d.start_broker()
        d.start_node("n1")
        client = d.client
        assert client.wait(client.submit("test", [{"echo": 1}]), timeout_s=60)[0].ok
        client.submit("test", [{"sleep_s": {"run": 60}}])
        d.wait_for(lambda st: st.jobs.get("run") == 1, 30, "a job running")
        journal = d.deployment_dir / "broker.journal"
        limits = resource.prlimit(broker.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(broker.pid, resource.RLIMIT_FSIZE, (journal.stat().st_size, limits[1]))
        with pytest.raises(JournalUnwritable):
            client.submit("test", [{"echo": 2}])
        d.client.stop()  # its cancel of the running job cannot be journaled either
        assert broker.wait(timeout=60) == 0, d.log("broker")
        assert "Traceback" not in d.log("broker"), d.log("broker")
        assert not journal.exists()
