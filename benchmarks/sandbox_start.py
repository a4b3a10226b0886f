"""Apptainer sandbox starts without FUSE: the node's unpacked copy vs ``--unsquash`` per start.

Requests ``--concurrent`` sandbox starts at once from a small SIF (the test
image, ``/var/cache/prorl-test/python.sif``) and from a >= 1 GB one (that
image plus a 1 GiB file of random bytes, built once into ``--big-dir``), and
measures, per start, the time from ``SandboxManager.start`` to the first
tool answer (``bash true``), the starts per second of the batch, and the CPU
seconds per start (this process and every child it reaped: Apptainer, its
starter, the tool server):

* ``unpacked copy, cold``: prorl as shipped (``sandbox.max_concurrent_starts``
  at its default), on a node that has no copy yet (the first start unpacks;
  the others wait for that one copy);
* ``unpacked copy, warm``: the same again (the copy exists);
* ``warm, all at once``: ``max_concurrent_starts`` = ``--concurrent``;
* ``--unsquash per start``: ``sandbox.unpack_cache: false`` (the old way).

As root it measures as the unprivileged ``prorl-test`` user (who has no
/dev/fuse here), on a copy of prorl that user can read.

    python benchmarks/sandbox_start.py [--concurrent 32] [--baseline-concurrent 32] [--big-gb 1]
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SMALL = Path("/var/cache/prorl-test/python.sif")
USER = "prorl-test"

INNER = r'''
import asyncio, json, logging, resource, sys, time
from pathlib import Path
from typing import Any
from prorl_cli.sandbox import SandboxConfig, SandboxManager

def cpu_s():
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))

async def batch(image, local_dir, state_dir, n, cache, cap):
    cfg = SandboxConfig(runtime="apptainer", image=image, local_dir=local_dir, unpack_cache=cache,
                        start_timeout_s=1800, **({"max_concurrent_starts": cap} if cap else {}))
    m = SandboxManager(cfg, Path(state_dir), logging.getLogger("bench"))
    async def one(i):
        t = time.perf_counter()
        sb = await m.start(f"s{i}")
        await sb.bash("true")
        return time.perf_counter() - t, sb
    c0, t0 = cpu_s(), time.perf_counter()
    done = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    await asyncio.gather(*(sb.stop() for _, sb in done))
    return {"times_s": [t for t, _ in done], "wall_s": wall, "cpu_s": cpu_s() - c0,
            "cap": cfg.max_concurrent_starts}

def breakdown(copy, toolserver, repeat=5):
    """Wall and CPU seconds of one start's parts, run one at a time on the unpacked copy."""
    import subprocess
    base = ["apptainer", "-s", "exec", "--containall", "--no-home", "--no-mount", "cwd", "--net", "--network", "none",
            "--writable-tmpfs", "--bind", f"{toolserver}:/opt/ts.py:ro", copy]
    parts = {"apptainer exec true": ["true"], "+ python3 -I -S -c pass": ["python3", "-I", "-S", "-c", "pass"],
             "+ tool server imports (--help)": ["python3", "-I", "-S", "/opt/ts.py", "--help"]}
    out = {}
    for label, cmd in parts.items():
        walls, cpus = [], []
        for _ in range(repeat):
            c0, t0 = cpu_s(), time.perf_counter()
            subprocess.run(base + cmd, check=True, stdout=subprocess.DEVNULL)
            walls.append(time.perf_counter() - t0)
            cpus.append(cpu_s() - c0)
        out[label] = {"wall_s": sorted(walls)[len(walls) // 2], "cpu_s": sorted(cpus)[len(cpus) // 2]}
    return out

async def main(a):
    out = {}
    for label, local, cache, n, cap in a["runs"]:
        out[label] = await batch(a["image"], local, a["state_dir"] + "/" + label.replace(" ", "_"), n, cache, cap)
    if a.get("breakdown"):
        copy = next(p for p in Path(a["runs"][0][1], "unpacked").iterdir() if (p / ".prorl-unpacked").exists())
        out["breakdown"] = breakdown(str(copy), a["toolserver"])
    print(json.dumps(out))

asyncio.run(main(json.loads(sys.argv[1])))
'''


def make_big(big_dir: Path, gb: float) -> Path:
    """The small test image plus ``gb`` GiB of random bytes in /opt/ballast.bin, built once."""
    target = big_dir / f"python-{gb:g}g.sif"
    if target.exists():
        return target
    big_dir.mkdir(parents=True, exist_ok=True)
    # No %post (it needs capabilities a container host may lack): unpack, add the file, pack.
    tree = big_dir / "tree"
    subprocess.run(["rm", "-rf", str(tree)], check=True)
    print(f"building {target} (once)...", flush=True)
    subprocess.run(["apptainer", "build", "--sandbox", str(tree), str(SMALL)], check=True, capture_output=True)
    (tree / "opt").mkdir(exist_ok=True)
    with open(tree / "opt" / "ballast.bin", "wb") as f:
        for _ in range(int(gb * 1024)):
            f.write(os.urandom(2**20))  # incompressible: the SIF stays this big
    subprocess.run(["apptainer", "build", str(target) + ".part", str(tree)], check=True, capture_output=True)
    subprocess.run(["rm", "-rf", str(tree)], check=True)
    os.rename(str(target) + ".part", target)
    return target


def measure(work: Path, image: Path, n: int, baseline_n: int, user: str | None,
            breakdown: bool = False) -> dict[str, dict[str, Any]]:
    state = work / f"state-{image.stem}"
    local = work / f"local-{image.stem}"
    for d in (state, local):
        d.mkdir(parents=True)
    # The cap None: sandbox.max_concurrent_starts at its shipped default; the rest wait their turn.
    runs = [["unpacked copy, cold", str(local / "a"), True, n, None],
            ["unpacked copy, warm", str(local / "a"), True, n, None],
            ["warm, all at once", str(local / "a"), True, n, n],
            ["--unsquash per start", str(local / "b"), False, baseline_n, None]]
    args = json.dumps({"image": str(image), "state_dir": str(state), "runs": runs, "breakdown": breakdown,
                       "toolserver": str(work / "prorl_cli" / "sandbox" / "toolserver.py")})
    cmd = [sys.executable if user is None else "/usr/bin/python3", str(work / "inner.py"), args]
    if user is not None:
        pw = pwd.getpwnam(user)
        subprocess.run(["chown", "-R", f"{pw.pw_uid}:{pw.pw_gid}", str(state), str(local)], check=True)
        cmd = ["runuser", "-u", user, "--", "env", f"PYTHONPATH={work}", *cmd]
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(work)})
    if proc.returncode != 0:
        sys.exit(f"measuring {image} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--baseline-concurrent", type=int, default=32, help="concurrent --unsquash starts")
    ap.add_argument("--big-gb", type=float, default=1.0)
    ap.add_argument("--big-dir", type=Path, default=Path("/var/tmp/prorl-bench"))
    args = ap.parse_args()
    if not SMALL.exists() or shutil.which("apptainer") is None:
        sys.exit(f"needs apptainer and {SMALL} (scripts/provision/30-apptainer.sh, 45-test-images.sh)")
    user = USER if os.geteuid() == 0 else None
    big = make_big(args.big_dir, args.big_gb)
    work = Path(tempfile.mkdtemp(prefix="prorl-bench-start-", dir="/var/tmp"))
    os.chmod(work, 0o755)
    try:
        shutil.copytree(ROOT / "prorl_cli", work / "prorl_cli", ignore=shutil.ignore_patterns("__pycache__"))
        (work / "inner.py").write_text(INNER)
        subprocess.run(["chmod", "-R", "a+rX", str(work)], check=True)
        print(f"Apptainer starts as {user or pwd.getpwuid(os.getuid()).pw_name} without FUSE, "
              f"{args.concurrent} at once (--unsquash: {args.baseline_concurrent} at once)")
        print(f"  {'image':<22}{'mode':<24}{'cap':>4}{'p50 s':>8}{'p90 s':>8}{'p99 s':>8}{'starts/s':>10}"
              f"{'CPU s/start':>12}")
        for image in (SMALL, big):
            size_mb = image.stat().st_size / 2**20
            res = measure(work, image, args.concurrent, args.baseline_concurrent, user, breakdown=image == SMALL)
            parts = res.pop("breakdown", None)
            for label, r in res.items():
                times = sorted(r["times_s"])
                p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
                p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
                print(f"  {image.name + f' ({size_mb:.0f} MB)':<22}{label:<24}{r['cap']:>4}{statistics.median(times):>8.2f}"
                      f"{p90:>8.2f}{p99:>8.2f}{len(times) / r['wall_s']:>10.2f}"
                      f"{r['cpu_s'] / len(times):>12.3f}", flush=True)
            if parts:
                print("  one start's parts, one at a time (median of 5; Apptainer on the unpacked copy):")
                for label, r in parts.items():
                    print(f"    {label:<34}{r['wall_s']:>8.3f} s wall{r['cpu_s']:>8.3f} s CPU", flush=True)
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)


if __name__ == "__main__":
    main()
