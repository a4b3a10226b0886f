"""The tool server in every runtime: bash on a PTY, python, editor, files."""

from __future__ import annotations

from typing import Any

import pytest

from tests.sandbox.conftest import ScenarioRunner

RUNTIMES = [
    pytest.param("local", None, id="local"),
    pytest.param("apptainer", "sif", id="apptainer-sif", marks=pytest.mark.apptainer),
    pytest.param("apptainer", "dir", id="apptainer-dir", marks=pytest.mark.apptainer),
    pytest.param("bwrap", "rootfs", id="bwrap-rootfs", marks=pytest.mark.bwrap),
    pytest.param("bwrap", "host", id="bwrap-host", marks=pytest.mark.bwrap),
]


@pytest.mark.parametrize(("runtime", "image"), RUNTIMES)
def test_tools(
    runtime: str, image: str | None, scenarios: ScenarioRunner, images: dict[str, str],
    request: pytest.FixtureRequest,
) -> None:
    if runtime != "local":
        request.getfixturevalue(f"need_{runtime}")
    config: dict[str, Any] = {"runtime": runtime}
    if image is not None:
        config["image"] = "host" if image == "host" else images[image]
    r = scenarios.run("tools", config)

    # bash: cwd and env persist across calls
    assert r["persist"] == "/tmp\nkept\n"
    # a sleep 100 is interrupted at its timeout, keeps what it printed, and the shell stays usable
    assert r["sleep"]["timed_out"] is True
    assert r["sleep"]["output"].startswith("started")
    assert r["sleep"]["restarted"] is False
    assert r["after_sleep"] == "usable\n/tmp\n"
    # a command that waits on stdin (cat, a prompt) is interrupted too, and the shell keeps its cwd and env
    assert r["reads_stdin"] == {name: {"timed_out": True, "restarted": False, "after": f"/tmp\n{name}\n"}
                                for name in ("cat", "python_input")}
    # 10 MB of output: truncated to the budget, with a note saying so
    assert r["big"]["truncated"] is True
    assert r["big"]["has_note"] is True
    assert r["big"]["total"] == 10_000_000
    assert r["big"]["len"] < 4096 + 200
    # a command that ends the shell reports its exit code; a fresh shell takes over
    assert r["exit"] == {"code": 7, "restarted": True, "after": "back\n"}
    # editor: str_replace with 0 and 2 matches gives clear errors
    assert "does not occur" in r["edit_errors"]["zero"] and "/tmp/e.txt" in r["edit_errors"]["zero"]
    assert "occurs 2 times" in r["edit_errors"]["two"] and "lines 1, 3" in r["edit_errors"]["two"]
    assert r["view"] == "     1\talpha\n     2\tinserted\n     3\tBETA"
    assert r["after_undo"] == "alpha\nBETA\nalpha\n"  # undo removed the insert only
    assert r["crlf"] == {"edited": "one\r\nins\r\nTWO\r\nthree\r\n", "view": "     1\tone\n     2\tins", "undone": True}
    # python: a persistent namespace, captured output, errors, interruptible
    assert r["python"] == {"stdout": "side\n", "result": "42", "error": None}
    assert r["python_error"].startswith("ZeroDivisionError")
    # binary output through sys.stdout.buffer: kept (not UTF-8: replaced), not an AttributeError
    assert r["python_binary"] == {"stdout": "text bytes \ufffd", "result": "7", "error": None}
    assert r["python_timeout"] == {"timed_out": True, "after": "20"}
    # files: a relative path is refused by name (it would resolve against the tool server's folder, not the shell's)
    assert r["relative_paths"] == {"read": "read_file: path must be absolute: 'relative.txt'",
                                   "write": "write_file: path must be absolute: 'rel.txt'"}
    # files: bytes round-trip exactly
    assert r["roundtrip"] is True
    assert r["shell_sees_size"] == str(256 + (1 << 20))
