"""Image cache: time to "image ready" for a no-change rebuild in each mode, against scratch.

All in one run, on this machine, through the real CLI (``prorl build-images``
as a child process, so Python start-up counts as it does for a user):

* ``small``: a Bootstrap: scratch image with busybox-static (about 1 MB);
* ``debian``: the shipped ``base`` recipe, a Debian minbase by debootstrap
  with python3 (skipped with ``--small-only`` or without debootstrap).

For each image: one build per mode to fill the cache, then ``--repeat``
no-change runs per mode, timed. scratch rebuilds every time; versioned and
lock reuse. Prints the median seconds per mode and the speed-up over scratch.

    python benchmarks/image_cache.py [--repeat 3] [--small-only]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
MODES = ("scratch", "versioned", "lock")

SMALL_TEMPLATE = """\
{% import "prorl.j2" as prorl with context %}
{{ bootstrap }}

%setup
    mkdir -p "$APPTAINER_ROOTFS/bin"
    cp /bin/busybox "$APPTAINER_ROOTFS/bin/busybox"
    ln -sf busybox "$APPTAINER_ROOTFS/bin/sh"

%files
{{ prorl.copy_files() }}

{{ prorl.metadata() }}
"""


def prorl(root: Path, *args: str) -> tuple[float, list[dict[str, object]]]:
    """Run ``prorl build-images --json ARGS``; return wall seconds and the results."""
    argv = [sys.executable, "-m", "prorl_cli", "--config", str(root / "prorl.yaml"), "build-images", "--json", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"prorl build-images {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return wall_s, json.loads(proc.stdout)


def bench(root: Path, image: str, repeat: int) -> dict[str, float]:
    medians: dict[str, float] = {}
    for mode in MODES:
        prorl(root, "--mode", mode, image)  # fill the cache (scratch: a first build)
        times = []
        for _ in range(repeat):
            wall_s, results = prorl(root, "--mode", mode, image)
            action = results[-1]["action"]
            expected = "built" if mode == "scratch" else "reused"
            assert action == expected, f"{image} {mode}: expected {expected}, got {action}"
            times.append(wall_s)
        medians[mode] = statistics.median(times)
        print(f"  {image:8s} {mode:9s} median {medians[mode]:7.2f} s  (runs: {', '.join(f'{t:.2f}' for t in times)})", flush=True)
    return medians


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="timed no-change runs per mode (small image)")
    ap.add_argument("--small-only", action="store_true", help="skip the debootstrap image")
    args = ap.parse_args()
    if shutil.which("apptainer") is None:
        raise SystemExit("apptainer is not installed")
    print(f"machine: {platform.node()} {platform.platform()}, {os.cpu_count()} CPUs; "
          f"{subprocess.run(['apptainer', '--version'], capture_output=True, text=True).stdout.strip()}")
    root = Path(tempfile.mkdtemp(prefix="prorl-bench-images-"))
    try:
        (root / "recipes").mkdir()
        (root / "recipes" / "small.def.j2").write_text(SMALL_TEMPLATE)
        (root / "images.yaml").write_text(yaml.safe_dump({"images": {
            "small": {"template": "small.def.j2", "base": "scratch"},
            "debian": {"template": "base.def.j2", "base": "debootstrap:bookworm", "variables": {"include": ["python3"]}},
        }}))
        (root / "prorl.yaml").write_text(yaml.safe_dump({"images": {
            "cache_dir": str(root / "cache"), "config_file": str(root / "images.yaml"), "recipe_dirs": [str(root / "recipes")],
        }}))
        rows = {"small": bench(root, "small", args.repeat)}
        if not args.small_only and shutil.which("debootstrap"):
            rows["debian"] = bench(root, "debian", 1)
        print("\nimage     scratch   versioned  lock      versioned/scratch  lock/scratch")
        for image, m in rows.items():
            print(f"{image:8s} {m['scratch']:7.2f} s {m['versioned']:7.2f} s {m['lock']:7.2f} s"
                  f"   {m['scratch'] / m['versioned']:8.1f}x faster   {m['scratch'] / m['lock']:8.1f}x faster")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
