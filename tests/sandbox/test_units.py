"""Bad input gets clear errors; the pieces that need no sandbox image."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from prorl_cli.config import config_from_dict
from prorl_cli.exceptions import ConfigError, SandboxError
from prorl_cli.sandbox import LoopbackAllocator, SandboxConfig, SandboxManager, make_runtime
from prorl_cli.sandbox.memory import tree_memory
from prorl_cli.sandbox.records import RecordStore, SandboxRecord, boot_id
from prorl_cli.sandbox.runtime import TOOLSERVER_PATH, proc_start_ticks
from prorl_cli.sandbox.toolserver import READY_LINE, recv_frame, send_frame

log = logging.getLogger("test")


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"runtime": "docker"}, "sandbox.runtime: expected one of ['auto', 'apptainer', 'bwrap', 'local'], got 'docker'"),
        ({"mem_gb": -1}, "sandbox.mem_gb: must be 0 (no limit) or positive, got -1"),
        ({"max_procs": 4}, "sandbox.max_procs: 4 is too few"),
        ({"writable": "yes"}, "sandbox.writable: expected one of"),
        ({"max_concurrent_starts": 0}, "sandbox.max_concurrent_starts: must be positive"),
        ({"fakeroot": "true"}, "sandbox.fakeroot: expected bool"),
        ({"no_such_key": 1}, "sandbox: unknown key(s) ['no_such_key']"),
    ],
)
def test_config_errors_name_the_key(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"sandbox": section}, "prorl.yaml")
    assert message in str(info.value)


def test_config_accepts_a_full_section() -> None:
    cfg = config_from_dict({"sandbox": {"runtime": "apptainer", "image": "/x.sif", "mem_gb": 2, "wall_s": 600}})
    assert cfg.sandbox.runtime == "apptainer" and cfg.sandbox.mem_gb == 2.0


def test_unknown_runtime_object_is_refused() -> None:
    with pytest.raises(SandboxError, match="unknown runtime 'podman'"):
        make_runtime(SandboxConfig(runtime="podman"), log)  # type: ignore[arg-type]


def test_start_errors_are_clear(tmp_path: Path) -> None:
    async def main() -> None:
        m = SandboxManager(SandboxConfig(runtime="local"), tmp_path, log)
        with pytest.raises(SandboxError, match=r"unknown sandbox option\(s\) \['gpu'\]"):
            await m.start("j", gpu=True)
        with pytest.raises(SandboxError, match="env must map str to str"):
            await m.start("j", env={"A": 1})
        long_dir = tmp_path / ("d" * 120)
        m2 = SandboxManager(SandboxConfig(runtime="local", local_dir=str(long_dir)), tmp_path, log)
        with pytest.raises(SandboxError, match="longer than 100 bytes; set sandbox.local_dir"):
            await m2.start("j")
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        m3 = SandboxManager(SandboxConfig(runtime="local", local_dir=str(shared)), tmp_path, log)
        with pytest.raises(SandboxError, match="is writable by others .mode 777."):
            await m3.start("j")
        assert m.live == [] and m2.live == [] and m3.live == []
        assert list((tmp_path / "sandboxes").glob("*.json")) == []

    asyncio.run(main())


def test_runtime_without_image_is_refused(tmp_path: Path) -> None:
    if subprocess.run(["which", "bwrap"], capture_output=True).returncode != 0:
        pytest.skip("bubblewrap is not installed (scripts/provision/20-bwrap.sh)")

    async def main() -> None:
        m = SandboxManager(SandboxConfig(runtime="bwrap"), tmp_path, log)
        with pytest.raises(SandboxError, match="no image given and sandbox.image is empty"):
            await m.start("j")
        # An Apptainer image handed to bubblewrap: named as such, with the way out.
        sif = tmp_path / "python.sif"
        sif.write_bytes(b"SIF")
        with pytest.raises(SandboxError, match=r"is a file; bubblewrap runs a folder image .* sandbox.runtime: apptainer"):
            await m.start("j", image=str(sif))

    asyncio.run(main())


def test_a_missing_default_image_is_said_when_the_node_starts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if subprocess.run(["which", "bwrap"], capture_output=True).returncode != 0:
        pytest.skip("bubblewrap is not installed (scripts/provision/20-bwrap.sh)")
    with caplog.at_level(logging.WARNING, logger="test"):
        make_runtime(SandboxConfig(runtime="bwrap", image=str(tmp_path / "no-such-image")), log)
    assert any("no-such-image' does not exist: every job that names no image of its own will fail in INIT"
               in r.getMessage() for r in caplog.records), caplog.text


def test_local_runtime_says_it_is_not_isolated(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        m = SandboxManager(SandboxConfig(runtime="local"), tmp_path, log)
        for _ in range(2):
            sb = await m.start("j", env={"GREETING": "hi"})
            assert (await sb.bash("echo $GREETING $PRORL_LOOPBACK_IP")).output == f"hi {sb.loopback_ip}\n"
            await sb.stop()
        with pytest.raises(SandboxError, match="is stopped"):
            await sb.bash("true")
        with pytest.raises(TypeError, match="write_file needs bytes, got str"):
            await sb.write_file("/tmp/x", "text")  # type: ignore[arg-type]

    with caplog.at_level(logging.WARNING, logger="test"):
        asyncio.run(main())
    assert sum("NO ISOLATION" in r.getMessage() for r in caplog.records) == 2


def test_loopback_allocator_is_thread_safe_and_reuses() -> None:
    alloc = LoopbackAllocator(prefix=9)
    got: list[str] = []
    lock = threading.Lock()

    def grab() -> None:
        mine = [alloc.allocate() for _ in range(500)]
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == len(set(got)) == 4000
    assert all(ip.startswith("127.9.") for ip in got)
    alloc.release(got[0])
    assert alloc.allocate() == got[0]
    with pytest.raises(ValueError, match="127.0.x.x is the host's"):
        LoopbackAllocator(prefix=0)


def test_loopback_allocator_exhaustion_is_an_error() -> None:
    alloc = LoopbackAllocator(prefix=3)
    for _ in range(256 * 254):
        alloc.allocate()
    with pytest.raises(SandboxError, match="loopback addresses of 127.3.x.y are in use"):
        alloc.allocate()


def test_reap_never_kills_a_process_it_did_not_start(tmp_path: Path) -> None:
    """A record whose pid now names another process (other start time) leaves it alone."""
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        ticks = proc_start_ticks(stranger.pid)
        assert ticks is not None
        store = RecordStore(tmp_path / "sandboxes", log)
        store.write(SandboxRecord("abc", "job", "apptainer", stranger.pid, stranger.pid, ticks - 1,
                                  boot_id(), str(tmp_path / "gone")))
        assert store.reap() == 0
        assert stranger.poll() is None  # still running
        assert store.load_all() == []  # the stale record is gone
    finally:
        os.killpg(stranger.pid, signal.SIGKILL)
        stranger.wait()


def test_toolserver_rejects_bad_frames(tmp_path: Path) -> None:
    sock_path = tmp_path / "t.sock"
    proc = subprocess.Popen([sys.executable, str(TOOLSERVER_PATH), "--socket", str(sock_path)],
                            stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().decode().strip() == READY_LINE
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(sock_path))
            send_frame(s, {"op": "teleport"})
            assert recv_frame(s) == {"ok": False, "error": {"type": "ToolError", "message": "unknown op 'teleport'"}}
            send_frame(s, {"op": "bash"})
            assert recv_frame(s)["error"]["message"] == "missing field 'command'"
            send_frame(s, {"op": "edit", "command": "view", "path": "relative.txt"})
            assert "path must be absolute" in recv_frame(s)["error"]["message"]
            s.sendall((0xFFFFFFF0).to_bytes(4, "big"))
            reply = recv_frame(s)
            assert reply["error"]["type"] == "ProtocolError" and "exceeds" in reply["error"]["message"]
        with socket.socket(socket.AF_UNIX) as s:  # still serving
            s.connect(str(sock_path))
            send_frame(s, {"op": "ping"})
            assert recv_frame(s)["ok"] is True
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    assert not sock_path.exists()


def test_wall_time_limit_stops_the_sandbox(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        m = SandboxManager(SandboxConfig(runtime="local", wall_s=0.5), tmp_path, log)
        sb = await m.start("slow-job")
        pid = sb.pid
        async with asyncio.timeout(30):
            await sb.wait_stopped()
        assert m.live == []
        assert proc_start_ticks(pid) is None
        with pytest.raises(SandboxError, match="is stopped"):
            await sb.bash("true")

    with caplog.at_level(logging.WARNING, logger="test"):
        asyncio.run(main())
    assert any("ran past sandbox.wall_s" in r.getMessage() for r in caplog.records)


def test_auto_runtime_is_the_default_and_falls_back_to_local_loudly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert SandboxConfig().runtime == "auto"
    monkeypatch.setenv("PATH", str(tmp_path))  # neither apptainer nor bwrap here
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with caplog.at_level(logging.WARNING, logger="test"):
        runtime = make_runtime(SandboxConfig(), log)
    assert runtime.name == "local" and not runtime.isolated
    assert "falling back to the LOCAL runtime" in caplog.text and "bwrap (bubblewrap) is not on PATH" in caplog.text


def test_auto_runtime_on_a_slurm_node_refuses_to_run_unisolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # neither apptainer nor bwrap here
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with pytest.raises(SandboxError, match="no isolating runtime works on this Slurm node") as e:
        make_runtime(SandboxConfig(), log)
    assert "bwrap (bubblewrap) is not on PATH" in str(e.value) and "sandbox.runtime: local" in str(e.value)
    # Chosen explicitly, the unisolated runtime is the operator's decision and is served.
    assert make_runtime(SandboxConfig(runtime="local"), log).name == "local"


def test_auto_runtime_prefers_apptainer_then_bubblewrap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, need_apptainer: None, need_bwrap: None
) -> None:
    assert make_runtime(SandboxConfig(), log).name == "apptainer"
    # Without apptainer on PATH, bubblewrap (if it works for this user).
    bwrap_only = tmp_path / "bin"
    bwrap_only.mkdir()
    import shutil

    (bwrap_only / "bwrap").symlink_to(shutil.which("bwrap") or "")
    monkeypatch.setenv("PATH", str(bwrap_only))
    assert make_runtime(SandboxConfig(), log).name == "bwrap"


def test_per_sandbox_limits_replace_the_nodes_and_mounts_need_an_isolating_runtime(tmp_path: Path) -> None:
    import resource

    from prorl_cli.sandbox import LaunchSpec, Mount, SandboxLimits
    from prorl_cli.sandbox.bwrap import BwrapRuntime

    host_procs = resource.getrlimit(resource.RLIMIT_NPROC)[0]

    async def main() -> None:
        m = SandboxManager(SandboxConfig(runtime="local", mem_gb=4.0, max_procs=512), tmp_path, log)
        sb = await m.start("limited", limits=SandboxLimits(mem_gb=1.5, max_procs=100))
        try:
            r = await sb.bash("ulimit -v; ulimit -u")
            # The process limit is not applied without isolation (it would count the user's host processes).
            procs = "unlimited" if host_procs == resource.RLIM_INFINITY else str(host_procs)
            assert r.output.split() == [str(int(1.5 * 1024 * 1024)), procs], r.output
        finally:
            await sb.stop()
        # An isolating runtime's tool server gets the sandbox's own process limit.
        limited = dataclasses.replace(m.config, max_procs=100)
        spec = LaunchSpec(sandbox_id="s", image="host", network=False, session_dir=tmp_path / "s",
                          loopback_ip="127.0.0.2", config=limited)
        argv = BwrapRuntime(SandboxConfig(runtime="bwrap"), log).toolserver_argv("/s.sock", spec=spec)
        assert argv[argv.index("--max-procs") + 1] == "100"
        with pytest.raises(SandboxError, match="local runtime .* cannot bind mounts"):
            await m.start("mounted", mounts=[Mount(str(tmp_path), "/data")])
        with pytest.raises(SandboxError, match="mount source .* does not exist"):
            await m.start("mounted", mounts=[Mount(str(tmp_path / "absent"), "/data")])
        with pytest.raises(SandboxError, match="sandbox limit mem_gb: expected a number"):
            await m.start("limited", limits=SandboxLimits(mem_gb=-1))
        await m.stop_all()

    asyncio.run(main())


def test_mounts_reach_the_runtime_command_lines(tmp_path: Path) -> None:
    from prorl_cli.sandbox import LaunchSpec, Mount
    from prorl_cli.sandbox.apptainer import ApptainerRuntime
    from prorl_cli.sandbox.bwrap import BwrapRuntime

    config = SandboxConfig(runtime="bwrap")
    mounts = [Mount(str(tmp_path), "/data"), Mount("/usr/share", "/share", writable=True)]
    spec = LaunchSpec(sandbox_id="s", image="host", network=False, session_dir=tmp_path / "s", loopback_ip="127.0.0.2",
                      config=config, mounts=mounts)
    bwrap = BwrapRuntime(config, log)
    if bwrap.binary is None:
        pytest.skip("bubblewrap is not installed (scripts/provision/20-bwrap.sh)")
    argv = bwrap.command(spec)
    assert ["--ro-bind", str(tmp_path), "/data"] == argv[argv.index("/data") - 2: argv.index("/data") + 1]
    assert argv[argv.index("/share") - 2: argv.index("/share") + 1] == ["--bind", "/usr/share", "/share"]
    apptainer = ApptainerRuntime(SandboxConfig(runtime="apptainer"), log)
    if apptainer.binary is None:
        pytest.skip("apptainer is not installed (scripts/provision/30-apptainer.sh)")
    argv = apptainer.command(spec)
    assert f"{tmp_path}:/data:ro" in argv and "/usr/share:/share:rw" in argv


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"disk_mb": -1}, "sandbox.disk_mb: must be 0 (no limit) or positive, got -1"),
        ({"disk_check_s": 0}, "sandbox.disk_check_s: must be positive"),
        ({"output_limit_mb": 0}, "sandbox.output_limit_mb: must be positive"),
        ({"memory_check_s": 0}, "sandbox.memory_check_s: must be positive"),
        ({"cgroups": "yes"}, "sandbox.cgroups: expected bool"),
    ],
)
def test_limit_settings_are_checked(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"sandbox": section}, "prorl.yaml")
    assert message in str(info.value)


HOLDER = """import os, sys
b = bytearray(64 << 20)
b[::4096] = b"x" * len(b[::4096])  # touched: resident
for _ in range(3):
    if os.fork() == 0:  # children share the 64 MB copy-on-write
        sys.stdin.read()
        os._exit(0)
print("held", flush=True)
sys.stdin.read()
"""


def test_tree_memory_counts_the_whole_tree_and_shared_pages_once(tmp_path: Path) -> None:
    """What the node measures where no memory cgroup bounds a sandbox: every process of the tree, with pages
    that a fork shares split among the processes (64 MB held by four processes is 64 MB, not 256)."""
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    # A shell between: the holders are grandchildren of the leader, as a sandbox's processes are of its runtime.
    leader = subprocess.Popen(["/bin/sh", "-c", f"{sys.executable} {script}; true"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert leader.stdout is not None and leader.stdout.readline() == "held\n"
        found = tree_memory([leader.pid])[leader.pid]
        assert found.processes == 5, found  # sh, the holder, its three children
        assert 64 << 20 <= found.rss_bytes < 96 << 20, found
    finally:
        leader.communicate("", timeout=30)


def test_output_limits_of_bash_and_python(tmp_path: Path) -> None:
    """A flood of output is interrupted at output_limit_mb; the python tool keeps head and tail of its streams."""

    async def main() -> None:
        m = SandboxManager(SandboxConfig(runtime="local", output_limit_mb=1, max_output_bytes=4096), tmp_path, log)
        sb = await m.start("flood")
        try:
            r = await sb.bash("yes | head -c 100000000; echo never")
            assert r.output_limited is True and r.truncated is True and r.timed_out is False
            assert 1 << 20 < r.output_bytes < 100_000_000 and "never" not in r.output
            assert (await sb.bash("echo next")).output == "next\n" and not (await sb.bash("true")).output_limited
            p = await sb.python("import sys\nfor _ in range(64): sys.stdout.write('y' * (1 << 20))\n'z' * 100000")
            assert len(p.stdout) < 4096 + 200 and "output truncated: 67108864 bytes in all" in p.stdout
            assert p.result is not None and len(p.result) < 4096 + 200 and "100002 characters in all" in p.result
        finally:
            await m.stop_all()

    asyncio.run(main())


def test_isolating_runtimes_get_only_harmless_variables_of_the_node(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    from prorl_cli.sandbox import LaunchSpec
    from prorl_cli.sandbox.bwrap import BwrapRuntime

    monkeypatch.setenv("PRORL_HOME", "/secret/home")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("APPTAINERENV_TOKEN", "x")
    monkeypatch.setenv("APPTAINER_BIND", "/secret")
    monkeypatch.setenv("APPTAINER_CACHEDIR", "/cache")
    config = SandboxConfig(runtime="bwrap")
    spec = LaunchSpec(sandbox_id="s", image="host", network=False, session_dir=tmp_path / "s",
                      loopback_ip="127.0.0.2", config=config)
    env = BwrapRuntime(config, log).host_env(spec)
    assert env.get("APPTAINER_CACHEDIR") == "/cache" and "PATH" in env
    assert not {"PRORL_HOME", "HF_TOKEN", "APPTAINERENV_TOKEN", "APPTAINER_BIND"} & set(env)
    local = make_runtime(SandboxConfig(runtime="local"), log).host_env(spec)
    assert local["HF_TOKEN"] == "hf_secret" and local["PRORL_LOOPBACK_IP"] == "127.0.0.2"  # no isolation anyway


def test_bounded_writable_places_on_the_command_lines(tmp_path: Path) -> None:
    """bwrap: a sized tmpfs root (scratch dirs are its own), a sized /dev/shm, /dev and /proc/sys read-only;
    Apptainer: /tmp, /var/tmp and /dev/shm in the session folder, the tool server told to bound and protect."""
    from prorl_cli.sandbox import LaunchSpec
    from prorl_cli.sandbox.apptainer import ApptainerRuntime
    from prorl_cli.sandbox.bwrap import BwrapRuntime

    rootfs = tmp_path / "rootfs"
    for d in ("usr", "etc", "tmp", "root"):
        (rootfs / d).mkdir(parents=True)
    size = str(64 << 20)

    def before(argv: list[str], target: str, n: int) -> list[str]:
        """``target`` (its first occurrence) and the ``n`` arguments before it."""
        at = argv.index(target)
        return argv[at - n: at + 1]

    for writable in ("overlay", "none"):
        config = SandboxConfig(runtime="bwrap", writable_size_mb=64, writable=writable)  # type: ignore[arg-type]
        spec = LaunchSpec(sandbox_id="s", image=str(rootfs), network=False, session_dir=tmp_path / "s",
                          loopback_ip="127.0.0.2", config=config)
        runtime = BwrapRuntime(config, log)
        runtime.binary = "/usr/bin/bwrap"
        argv = runtime.command(spec)
        assert before(argv, "/", 3) == ["--size", size, "--tmpfs", "/"]  # the first mount: the writable layer
        assert before(argv, "/dev/shm", 3) == ["--size", size, "--tmpfs", "/dev/shm"]
        assert before(argv, "/dev", 1) == ["--dev", "/dev"] and argv[argv.index("--remount-ro") + 1] == "/dev"
        assert argv[argv.index("/proc/sys") - 1: argv.index("/proc/sys") + 2] == ["--ro-bind", "/proc/sys", "/proc/sys"]
        assert before(argv, "/etc", 2) == ["--ro-bind", str(rootfs / "etc"), "/etc"]
        if writable == "overlay":
            assert before(argv, "/tmp", 1) == ["--dir", "/tmp"] and before(argv, "/root", 1) == ["--dir", "/root"]
            assert argv.count("--remount-ro") == 1
        else:  # a read-only root: /tmp is a tmpfs of its own, /root the image's
            assert before(argv, "/tmp", 3) == ["--size", size, "--tmpfs", "/tmp"]
            assert before(argv, "/root", 2) == ["--ro-bind", str(rootfs / "root"), "/root"]
            assert argv[len(argv) - argv[::-1].index("--remount-ro") - 1:][:2] == ["--remount-ro", "/"]
        assert "--max-file-mb" in argv
    config = SandboxConfig(runtime="apptainer", writable_size_mb=64)
    spec = LaunchSpec(sandbox_id="s", image=str(rootfs), network=False, session_dir=tmp_path / "s",
                      loopback_ip="127.0.0.2", config=config)
    apptainer = ApptainerRuntime(config, log)
    apptainer.binary = "/usr/bin/apptainer"
    argv = apptainer.command(spec)
    scratch = tmp_path / "s" / "scratch"
    assert ["--workdir", str(scratch), "--bind", f"{scratch / 'shm'}:/dev/shm"] == \
        argv[argv.index("--workdir"): argv.index("--workdir") + 4]
    assert (scratch / "shm").stat().st_mode & 0o7777 == 0o1777
    assert argv[-3:] == ["--scratch-mb", "64", "--protect-host"]


def test_sandbox_cgroup_files(tmp_path: Path) -> None:
    """Limits, members, events and removal, on a stand-in of the cgroup files (v1: two directories, v2: one)."""
    from prorl_cli.sandbox.cgroups import PREFIX, CgroupParents, SandboxCgroup, remove_paths

    def fake(version: int) -> CgroupParents:
        parents = []
        for controller in ("pids", "memory") if version == 1 else ("unified",):
            parent = tmp_path / f"v{version}" / controller
            parent.mkdir(parents=True)
            parents.append(parent)
        return CgroupParents(version, tuple(parents))

    def populate(group: SandboxCgroup, files: dict[str, str]) -> None:
        """The files a kernel would show: v1 pids.* in the first directory, memory.* in the second."""
        for d in group.dirs:
            (d / "cgroup.procs").write_text("")
        for name, text in files.items():
            target = group.dirs[1] if group.version == 1 and name.startswith("memory.") else group.dirs[0]
            (target / name).write_text(text)

    v1 = fake(1)
    with pytest.raises(OSError):  # an empty directory is no cgroup: nothing is left behind
        v1.create("abc", 64, 1 << 29)
    assert [list(p.iterdir()) for p in v1.dirs] == [[], []]
    group = SandboxCgroup(1, tuple(p / f"{PREFIX}abc" for p in v1.dirs))
    for d in group.dirs:
        d.mkdir()
    populate(group, {"pids.max": "max", "memory.limit_in_bytes": "0", "pids.events": "max 7\n",
                     "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"})
    group.set_limits(64, 1 << 29)
    assert (group.dirs[0] / "pids.max").read_text() == "64"
    assert (group.dirs[1] / "memory.limit_in_bytes").read_text() == str(1 << 29)
    assert group.events() == {"oom_kill": 2, "pids_max": 7}
    assert group.members() == [] and group.kill() == []
    assert [str(p) for p in group.procs_files] == [str(d / "cgroup.procs") for d in group.dirs]
    assert group.remove() == list(group.dirs)  # not empty (here: files), so not removable; no waiting for that
    for d in group.dirs:
        for f in d.iterdir():
            f.unlink()
    assert group.remove() == [] and not any(d.exists() for d in group.dirs)
    v2 = SandboxCgroup(2, (fake(2).dirs[0] / f"{PREFIX}xyz",))
    v2.dirs[0].mkdir()
    populate(v2, {"pids.max": "max", "memory.max": "max", "memory.swap.max": "max", "pids.events": "max 0\n",
                  "memory.events": "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n"})
    v2.set_limits(100, 1 << 30)
    assert (v2.dirs[0] / "memory.max").read_text() == str(1 << 30)
    assert (v2.dirs[0] / "memory.swap.max").read_text() == "0"
    assert v2.events() == {"oom_kill": 1, "pids_max": 0}
    # Only prorl-sandbox-* directories are ever removed (files in them: these are no real cgroups, so rmdir fails).
    assert remove_paths([str(tmp_path)]) == []
    assert tmp_path.exists()


def test_a_start_that_prints_something_else_and_runs_on_fails_naming_it(tmp_path: Path) -> None:
    """The runtime printed another line than the ready line and did not exit: the start fails (never waits
    for the exit for good, holding one of max_concurrent_starts), and what it started is stopped."""
    from prorl_cli.sandbox import LaunchSpec
    from prorl_cli.sandbox.local import LocalRuntime

    class Chatty(LocalRuntime):
        def command(self, spec: LaunchSpec) -> list[str]:
            return [sys.executable, "-c", "import sys, time; print('hello from sitecustomize', flush=True); "
                                          "time.sleep(600)"]

    async def main() -> None:
        config = SandboxConfig(runtime="local")
        spec = LaunchSpec(sandbox_id="s", image="host", network=False, session_dir=tmp_path / "s",
                          loopback_ip="127.0.0.2", config=config)
        spawned = []
        with pytest.raises(SandboxError, match="printed b'hello from sitecustomize\\\\n' instead of its ready line"):
            await Chatty(config, log).start(spec, on_spawn=spawned.append)
        (process,) = spawned
        assert process.proc.returncode is not None  # stopped, not left running

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_local_runtime_leaves_the_users_process_limit_alone(tmp_path: Path) -> None:
    """Without a user namespace RLIMIT_NPROC counts every process of the node's user on the host: set to
    max_procs, it made a local sandbox's forks fail for processes that were not its own."""
    import resource

    host_soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    host = "unlimited" if host_soft == resource.RLIM_INFINITY else str(host_soft)

    async def main() -> str:
        m = SandboxManager(SandboxConfig(runtime="local", max_procs=64), tmp_path, log)
        sb = await m.start("j")
        try:
            return (await sb.bash("ulimit -u")).output.strip()
        finally:
            await sb.stop()

    assert asyncio.run(main()) == host
