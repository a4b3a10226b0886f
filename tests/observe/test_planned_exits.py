"""Planned exits are not losses: a bridge stopped with SIGTERM or SIGUSR2 has ``left``; one killed is ``lost``.

Real processes: the observability deployment's broker and three simulated-engine
bridges of its own, stopped three ways. Logs, ``prorl status`` and its JSON say
the same thing.
"""

from __future__ import annotations

import json
import os
import signal

from tests.observe.conftest import ObservedRun

WAYS = {"sim-term": signal.SIGTERM, "sim-usr2": signal.SIGUSR2, "sim-kill": signal.SIGKILL}


def test_bridges_that_leave_on_purpose_have_left_and_a_killed_one_is_lost(observed_run: ObservedRun) -> None:
    d = observed_run.deployment
    procs = {name: d.spawn(name, "serve", "inference", "--backend-id", name, "--engine", "sim") for name in WAYS}
    d.wait_for(lambda st: set(WAYS) <= {b.backend_id for b in st.backends if b.alive}, 120.0,
               "the three bridges to register", "sim-kill")
    for name, sig in WAYS.items():
        if sig == signal.SIGKILL:
            os.killpg(procs[name].pid, sig)  # no goodbye: the broker finds it silent
        else:
            procs[name].send_signal(sig)
    for name in ("sim-term", "sim-usr2"):
        assert procs[name].wait(60) == 0, d.log(name)
    status = d.wait_for(lambda st: set(WAYS) <= {b.backend_id for b in st.gone_backends}, 60.0,
                        "the three bridges to be gone")
    reasons = {b.backend_id: b.gone_reason for b in status.gone_backends if b.backend_id in WAYS}
    assert reasons["sim-term"] == reasons["sim-usr2"] == "left", reasons
    assert (reasons["sim-kill"] or "").startswith("silent for"), reasons
    assert not any(b.backend_id in WAYS for b in status.backends)

    log = (d.logs / "broker.log").read_text()
    for name in ("sim-term", "sim-usr2"):
        assert f"backend {name} left" in log and f"backend {name} lost" not in log
    assert "backend sim-kill lost: silent for" in log

    table = observed_run.prorl("status")
    assert table.returncode == 0, table.stderr
    rows = {name: next(line for line in table.stdout.splitlines() if f" {name} " in line) for name in WAYS}
    assert "left" in rows["sim-term"] and "lost" not in rows["sim-term"], table.stdout
    assert "lost: silent for" in rows["sim-kill"], table.stdout
    as_json = observed_run.prorl("status", "--json")
    gone = {b["backend_id"]: b["gone_reason"] for b in json.loads(as_json.stdout)["gone_backends"]}
    assert gone["sim-usr2"] == "left" and gone["sim-kill"].startswith("silent for")
