"""Real ``apptainer build --fakeroot`` of small scratch-bootstrap images: modes, failures, concurrency, kills."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_cli.exceptions import ImageBuildError
from prorl_cli.images import resolve_image

from .conftest import Workspace, needs_apptainer, stop

pytestmark = [needs_apptainer, pytest.mark.apptainer]


def image_cat(image: str, path: str) -> str:
    """Read a file inside a built image (as root Apptainer needs --userns here)."""
    args = ["apptainer", "exec", *(["--userns"] if os.geteuid() == 0 else []), image, "cat", path]
    return subprocess.run(args, capture_output=True, text=True, check=True, timeout=60).stdout


def test_copied_file_change_lock_rebuilds_versioned_reuses(ws: Workspace) -> None:
    lock1 = ws.build("--mode", "lock")["tiny"]
    ver1 = ws.build("--mode", "versioned")["tiny"]
    assert lock1["action"] == ver1["action"] == "built"
    assert image_cat(lock1["path"], "/data.txt") == "one\n"
    # No change: the very same file is reused.
    same = ws.build("--mode", "lock")["tiny"]
    assert (same["action"], same["key"], same["path"]) == ("reused", lock1["key"], lock1["path"])
    (ws.root / "data.txt").write_text("two\n")
    lock2 = ws.build("--mode", "lock")["tiny"]
    ver2 = ws.build("--mode", "versioned")["tiny"]
    assert lock2["action"] == "built" and lock2["key"] != lock1["key"]
    assert any("files./data.txt" in r for r in lock2["reasons"]), lock2["reasons"]
    assert image_cat(lock2["path"], "/data.txt") == "two\n"
    assert ver2["action"] == "reused" and ver2["key"] == ver1["key"] and ver2["path"] == ver1["path"]
    assert "same base reference and prorl version" in ver2["reasons"][0]
    m = ws.manifest()
    assert m["images"]["tiny"] == ver1["key"]  # the last make-ready decides what "tiny" resolves to
    entry = m["builds"][lock2["key"]]
    assert entry["mode"] == "lock" and entry["template"] == "busybox.def.j2" and entry["base"] == "scratch"
    assert entry["size_bytes"] == Path(lock2["path"]).stat().st_size > 0
    assert entry["prorl_version"] and entry["built_at"]


def test_base_change_rebuilds_in_both_modes(ws: Workspace) -> None:
    images = {
        "root1": {"template": "busybox.def.j2", "base": "scratch", "variables": {"message": "root one"}},
        "root2": {"template": "busybox.def.j2", "base": "scratch", "variables": {"message": "root two"}},
        "child": {"template": "busybox.def.j2", "base": "image:root1", "variables": {"message": "child"}},
    }
    ws.write(images)
    first = {m: ws.build("--mode", m, "child") for m in ("lock", "versioned")}
    for results in first.values():
        assert list(results) == ["root1", "child"]  # the base first
        assert results["child"]["action"] == "built"
    ws.write({**images, "child": {**images["child"], "base": "image:root2"}})
    for mode in ("lock", "versioned"):
        again = ws.build("--mode", mode, "child")
        assert list(again) == ["root2", "child"]
        assert again["child"]["action"] == "built", (mode, again["child"])
        assert again["child"]["key"] != first[mode]["child"]["key"]
        assert any("base" in r for r in again["child"]["reasons"]), again["child"]["reasons"]
    # A rebuilt base (its lock key moved) rebuilds its dependents in lock mode too.
    ws.write({**images, "root2": {**images["root2"], "variables": {"message": "root two, new"}}, "child": {**images["child"], "base": "image:root2"}})
    again = ws.build("--mode", "lock", "child")
    assert again["root2"]["action"] == "built" and again["child"]["action"] == "built"


def test_scratch_always_rebuilds(ws: Workspace) -> None:
    counter = ws.root / "builds.txt"
    ws.write({"tiny": {**ws.images["tiny"], "variables": {"counter": str(counter)}}})
    a = ws.build("--mode", "scratch")["tiny"]
    b = ws.build("--mode", "scratch")["tiny"]
    assert a["action"] == b["action"] == "built"
    assert a["key"] == b["key"] and a["reasons"] == ["scratch mode always rebuilds"]
    assert counter.read_text().splitlines() == ["tiny", "tiny"]


def test_keys_and_decisions_are_stable_across_processes(ws: Workspace) -> None:
    planned = ws.dry_run("--mode", "lock")["tiny"]
    built = ws.build("--mode", "lock")["tiny"]
    assert built["key"] == planned["key"] and built["path"] == planned["path"]
    again = ws.dry_run("--mode", "lock")["tiny"]
    assert again["key"] == planned["key"] and again["action"] == "would-reuse"
    assert ws.manifest()["builds"][planned["key"]]["inputs"] == planned["inputs"]
    out = ws.prorl("build-images", "--mode", "lock")
    assert f"tiny: lock key {planned['key']} → reuse" in out.stdout


def test_failed_build_leaves_no_image_and_shows_step_and_tail(ws: Workspace) -> None:
    ws.write({"tiny": {**ws.images["tiny"], "variables": {"fail": "deliberate failure 4711"}}})
    out = ws.prorl("build-images", "--mode", "lock", check=False)
    assert out.returncode == 1
    assert "FAILED" in out.stdout and "at step: Running post scriptlet" in out.stdout, out.stdout
    assert "deliberate failure 4711" in out.stdout  # the tail of Apptainer's output
    assert f"full log: {ws.cache / 'logs' / 'tiny'}" in out.stdout
    key = ws.dry_run()["tiny"]["key"]
    assert not any((ws.cache / "images" / "tiny").glob("*.sif")), "no half-written image"
    assert not any((ws.cache / "images" / "tiny").glob(".*"))
    assert "tiny" not in ws.manifest()["images"] if (ws.cache / "manifest.json").exists() else True
    assert "deliberate failure 4711" in (ws.cache / "logs" / "tiny" / f"{key}.log").read_text()
    # The failed build's definition and log are the user's to read until a prune, which removes them.
    pruned = ws.prorl("images", "prune", "--dry-run").stdout
    assert f"tiny {key}: a failed build's def and log" in pruned and (ws.cache / "logs" / "tiny" / f"{key}.log").exists()
    pruned = ws.prorl("images", "prune").stdout
    assert f"tiny {key}: a failed build's def and log" in pruned, pruned
    assert not any((ws.cache / "logs" / "tiny").glob(f"{key}.*"))


def test_a_failure_is_reported_at_apptainers_step_not_at_its_hint(ws: Workspace) -> None:
    """A failure while squashing was reported "at step: To see mksquashfs output ... enable verbose logging"."""
    ws.write(build_args=["--mksquashfs-args", "-comp no-such-compressor"])
    out = ws.prorl("build-images", "--mode", "lock", check=False)
    assert out.returncode == 1
    assert "at step: Creating SIF file" in out.stdout, out.stdout
    assert "failed command" not in out.stdout  # the last %post command ran fine: it is not named


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB file system (a tmpfs) to hold an image cache: smaller than any image."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to mount a small tmpfs as a full disk")
    where = tmp_path / "full"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(where)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_fails_the_build_with_a_way_out_and_leaves_no_image(ws: Workspace, full_disk: Path) -> None:
    cache = full_disk / "cache"
    out = ws.prorl("build-images", "--mode", "lock", "--cache-dir", str(cache), check=False)
    assert out.returncode == 1
    assert "at step: Creating SIF file" in out.stdout and "no space left on device" in out.stdout, out.stdout
    assert "hint: a file system is full" in out.stdout and "prorl images prune" in out.stdout, out.stdout
    assert not any((cache / "images").rglob("*.sif")), "no half-written image"
    listed = ws.prorl("images", "list", "--cache-dir", str(cache)).stdout
    assert "no images in" in listed


def test_missing_base_skips_dependent(ws: Workspace) -> None:
    ws.write({"bad": {"template": "busybox.def.j2", "base": "scratch", "variables": {"fail": "no"}},
              "child": {"template": "busybox.def.j2", "base": "image:bad"}})
    out = ws.prorl("build-images", "--json", "child", check=False)
    results = {r["name"]: r for r in json.loads(out.stdout)}
    assert out.returncode == 1
    assert results["bad"]["action"] == "failed" and results["child"]["action"] == "skipped"
    assert results["child"]["reasons"] == ["base image bad failed"]


def _json_results(output: str) -> list[dict[str, object]]:
    """The --json array in output that also holds progress lines (stderr merged into stdout)."""
    start = 0 if output.startswith("[") else output.index("\n[") + 1
    data: list[dict[str, object]] = json.loads(output[start:])
    return data


def _reader(proc: subprocess.Popen[str], lines: list[str], waiting: threading.Event) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if "waiting for" in line:
            waiting.set()


def test_two_processes_at_once_build_once(ws: Workspace) -> None:
    started, gate, counter = ws.root / "started", ws.root / "gate", ws.root / "builds.txt"
    os.mkfifo(started)
    os.mkfifo(gate)
    ws.write({"tiny": {**ws.images["tiny"], "variables": {"started": str(started), "gate": str(gate), "counter": str(counter)}}})
    procs = [ws.start("build-images", "--json", "--mode", "lock") for _ in range(2)]
    outputs: list[list[str]] = [[], []]
    waiting = threading.Event()
    readers = [threading.Thread(target=_reader, args=(p, out, waiting), daemon=True) for p, out in zip(procs, outputs, strict=True)]
    for t in readers:
        t.start()
    try:
        assert Path(started).read_text() == "started\n"  # blocks until one build is inside %setup
        assert waiting.wait(120), "the second process never reported waiting for the lock"
        with open(gate, "w"):
            pass  # release the build
        for p in procs:
            assert p.wait(120) == 0
    finally:
        for p in procs:
            stop(p)
    for t in readers:
        t.join(10)
    assert counter.read_text().splitlines() == ["tiny"], "built exactly once"
    results = [_json_results("".join(out))[0] for out in outputs]
    assert sorted(r["action"] for r in results) == ["built", "reused"]
    reused = next(r for r in results if r["action"] == "reused")
    assert reused["reasons"][0].startswith("built meanwhile by pid")
    assert results[0]["path"] == results[1]["path"] and Path(results[0]["path"]).is_file()


def test_killed_build_leaves_cache_consistent(ws: Workspace) -> None:
    started, gate = ws.root / "started", ws.root / "gate"
    os.mkfifo(started)
    os.mkfifo(gate)
    ws.build("--mode", "versioned")  # an earlier, good entry the kill must not disturb
    ws.write({"tiny": {**ws.images["tiny"], "variables": {"started": str(started), "gate": str(gate), "message": "v2"}}})
    before = ws.manifest()
    proc = ws.start("build-images", "--mode", "lock")
    try:
        assert Path(started).read_text() == "started\n"
        os.killpg(proc.pid, signal.SIGKILL)  # prorl dies mid-build; Apptainer dies with it (pdeathsig)
        proc.wait(30)
    finally:
        stop(proc)
        _release(gate)  # in case anything of the killed build still waits at the gate
    assert ws.manifest() == before
    assert not any((ws.cache / "images" / "tiny").glob("lock-*.sif"))
    # The next build takes the (released) lock, clears leftovers and succeeds.
    nxt = ws.start("build-images", "--json", "--mode", "lock")
    try:
        assert Path(started).read_text() == "started\n"
        _release(gate, block=True)
        out, _ = nxt.communicate(timeout=120)
    finally:
        stop(nxt)
    assert nxt.returncode == 0, out
    result = _json_results(out)[0]
    assert result["action"] == "built"
    assert image_cat(result["path"], "/message") == "v2\n"
    assert not [p for p in (ws.cache / "images" / "tiny").iterdir() if ".tmp-" in p.name]
    assert ws.manifest()["images"]["tiny"] == result["key"]


def _release(gate: Path, block: bool = False) -> None:
    """Open the gate FIFO for writing (EOF for its reader); without ``block``, only if someone reads it."""
    try:
        fd = os.open(gate, os.O_WRONLY | (0 if block else os.O_NONBLOCK))
    except OSError:
        return  # ENXIO: nobody is reading
    os.close(fd)


def test_list_show_prune_and_resolve(ws: Workspace) -> None:
    first = ws.build()["tiny"]
    (ws.root / "data.txt").write_text("two\n")
    second = ws.build()["tiny"]
    assert resolve_image("tiny", ws.cache) == Path(second["path"])
    listed = json.loads(ws.prorl("images", "list", "--json", "--cache-dir", str(ws.cache)).stdout)
    assert list(listed) == ["tiny"] and listed["tiny"]["key"] == second["key"]
    assert listed["tiny"]["path"] == second["path"]  # absolute, as build-images and show print it
    table = ws.prorl("images", "list", "--cache-dir", str(ws.cache)).stdout
    assert second["path"] in table and "(missing)" not in table
    shown = json.loads(ws.prorl("images", "show", "tiny").stdout.split("\n}\n")[0] + "\n}")
    assert shown["path"] == second["path"]
    assert "Bootstrap: scratch" in ws.prorl("images", "show", "tiny", "--definition").stdout
    pruned = ws.prorl("images", "prune").stdout
    assert first["key"] in pruned and "1 item(s) removed" in pruned
    assert not Path(first["path"]).exists() and Path(second["path"]).exists()
    assert first["key"] not in ws.manifest()["builds"]
    with pytest.raises(ImageBuildError, match="'nothing' is not in"):
        resolve_image("nothing", ws.cache)
    Path(second["path"]).unlink()
    with pytest.raises(ImageBuildError, match="missing; rebuild it"):
        resolve_image("tiny", ws.cache)


def test_parallel_jobs_build_independent_images_and_their_dependents(ws: Workspace) -> None:
    ws.write({
        "a": {"template": "busybox.def.j2", "base": "scratch", "variables": {"message": "a"}},
        "b": {"template": "busybox.def.j2", "base": "scratch", "variables": {"message": "b"}},
        "c": {"template": "busybox.def.j2", "base": "image:a", "variables": {"message": "c"}},
    })
    results = ws.build("--jobs", "2")
    assert {n: r["action"] for n, r in results.items()} == {"a": "built", "b": "built", "c": "built"}
    assert image_cat(results["c"]["path"], "/message") == "c\n"
    assert {n: r["action"] for n, r in ws.build("--jobs", "2").items()} == {"a": "reused", "b": "reused", "c": "reused"}


def _processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (to find what a stopped build left running)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                pids.append(int(entry))
    return pids


def test_sigterm_stops_a_build_and_a_waiter_cleanly(ws: Workspace) -> None:
    started, gate = ws.root / "started", ws.root / "gate"
    os.mkfifo(started)
    os.mkfifo(gate)
    ws.write({"tiny": {**ws.images["tiny"], "variables": {"started": str(started), "gate": str(gate)}}})
    procs = [ws.start("build-images", "--mode", "lock") for _ in range(2)]
    outputs: list[list[str]] = [[], []]
    waiting = threading.Event()  # set by whichever reader sees "waiting for"
    for p, out in zip(procs, outputs, strict=True):
        threading.Thread(target=_reader, args=(p, out, waiting), daemon=True).start()
    builder, waiter = procs
    try:
        assert Path(started).read_text() == "started\n"
        # Whichever process got the lock is building; the other reports waiting.
        assert waiting.wait(60), "no process reported waiting for the lock"
        if any("waiting for" in line for line in outputs[0]):
            waiter, builder = procs
        os.killpg(waiter.pid, signal.SIGTERM)  # a waiter leaves at once, the build goes on
        assert waiter.wait(60) == 128 + signal.SIGTERM
        assert builder.poll() is None
        os.killpg(builder.pid, signal.SIGTERM)  # the builder stops its build, orphans included
        assert builder.wait(60) == 128 + signal.SIGTERM
    finally:
        stop(waiter)
        stop(builder)
        _release(gate)
    assert _processes_mentioning(str(gate)) == [], "the stopped build left processes behind"
    leftovers = list((ws.cache / "images" / "tiny").iterdir()) if (ws.cache / "images" / "tiny").exists() else []
    assert leftovers == [], leftovers
    assert "tiny" not in ws.manifest()["images"] if (ws.cache / "manifest.json").exists() else True


def test_chained_base_with_foreign_owners_fails_with_a_hint(ws: Workspace) -> None:
    """Apptainer 1.4 cannot extract such a base under --fakeroot (apptainer/apptainer#3186): say so, leave nothing."""
    ws.write({"owned": {"template": "busybox.def.j2", "base": "scratch", "variables": {"foreign": "shadow"}},
              "child": {"template": "busybox.def.j2", "base": "image:owned"}})
    out = ws.prorl("build-images", "--json", "child", check=False)
    results = {r["name"]: r for r in json.loads(out.stdout)}
    assert results["owned"]["action"] == "built"
    if results["child"]["action"] == "built":
        assert image_cat(results["child"]["path"], "/message") == "hello\n"
        return  # a later Apptainer extracts such bases: nothing to explain
    assert out.returncode == 1 and results["child"]["action"] == "failed"
    assert "at step: Extracting local image" in results["child"]["error"]
    assert "apptainer/apptainer#3186" in results["child"]["error"]
    assert not [p for p in (ws.cache / "images" / "child").iterdir()]


def test_localimage_base_bytes_move_the_lock_key_not_the_versioned_one(ws: Workspace) -> None:
    ws.write({"seed": {"template": "busybox.def.j2", "base": "scratch", "variables": {"message": "seed one"}}})
    seed = ws.build()["seed"]
    base_sif = ws.root / "base.sif"
    shutil.copy(seed["path"], base_sif)
    child = {"template": "busybox.def.j2", "base": "localimage:base.sif", "variables": {"message": "child"}}
    ws.write({"seed": ws.images["seed"], "child": child})
    lock1, ver1 = ws.build("--mode", "lock", "child")["child"], ws.build("--mode", "versioned", "child")["child"]
    assert lock1["action"] == ver1["action"] == "built"
    assert f"From: {base_sif}" in (ws.cache / ws.manifest()["builds"][lock1["key"]]["definition"]).read_text()
    # Same path, new bytes: lock rebuilds, versioned (same reference) reuses.
    ws.write({"seed": {**ws.images["seed"], "variables": {"message": "seed two"}}, "child": child})
    shutil.copy(ws.build("seed")["seed"]["path"], base_sif)
    lock2, ver2 = ws.build("--mode", "lock", "child")["child"], ws.build("--mode", "versioned", "child")["child"]
    assert lock2["action"] == "built" and any("base_image" in r for r in lock2["reasons"]), lock2["reasons"]
    assert ver2["action"] == "reused" and ver2["key"] == ver1["key"]
