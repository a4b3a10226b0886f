"""A Dockerfile's ``COPY . /app/`` whose context holds what ``.dockerignore`` leaves out: this tree against a
baseline tree, in one run, through the real CLI.

The context is what a project's checkout looks like: a small source tree, a
``data/`` folder of ``--data-mb`` MB (random bytes, so nothing compresses it
away) and a ``.git`` of ``--git-files`` small files, both named in
``.dockerignore``. For each tree, alternating rounds: the lock key alone
(``build-images --dry-run``, which hashes the inputs) and a full build
(``--mode scratch``), timed, and the image's size.

    python benchmarks/image_context.py [--baseline 1eefa00] [--data-mb 400] [--repeat 3]

``--baseline``: a directory holding another prorl tree, or a git ref of this
repository (default: the commit before left-out files stopped being copied).
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

# Run as a script, this folder is on the path: the same base image and baseline trees as its neighbours'.
from image_cache import SMALL_TEMPLATE
from pipeline_overhead import baseline_tree

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = "FROM busybox\nRUN /bin/busybox --install -s /bin\nWORKDIR /app\nCOPY . /app/\nRUN ls /app > /listing\n"


def make_context(root: Path, data_mb: int, git_files: int) -> None:
    ctx = root / "ctx"
    (ctx / "src").mkdir(parents=True)
    for i in range(50):
        (ctx / "src" / f"m{i}.py").write_text(f"VALUE = {i}\n")
    (ctx / "data").mkdir()
    for i in range(8):
        (ctx / "data" / f"shard{i}.bin").write_bytes(os.urandom(data_mb * 1024 * 1024 // 8))
    objects = ctx / ".git" / "objects"
    for i in range(git_files):
        folder = objects / f"{i % 256:02x}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:038x}").write_bytes(os.urandom(512))
    (ctx / ".dockerignore").write_text(".git\ndata\n")
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    (root / "recipes").mkdir()
    (root / "recipes" / "root.def.j2").write_text(SMALL_TEMPLATE)
    (root / "images.yaml").write_text(yaml.safe_dump({"images": {
        "root": {"template": "root.def.j2", "base": "scratch"},
        "app": {"template": "ctx/Dockerfile", "base": "image:root"},
    }}))


def prorl(tree: Path, root: Path, cache: Path, *args: str) -> tuple[float, list[dict[str, object]]]:
    """Run ``prorl build-images --json ARGS`` from ``tree``; return wall seconds and the results."""
    (root / "prorl.yaml").write_text(yaml.safe_dump({"images": {
        "cache_dir": str(cache), "config_file": str(root / "images.yaml"), "recipe_dirs": [str(root / "recipes")],
    }}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    env["PYTHONPATH"] = str(tree)
    argv = [sys.executable, "-m", "prorl_cli", "--config", str(root / "prorl.yaml"), "build-images", "--json", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: prorl build-images {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return wall_s, json.loads(proc.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="1eefa00", help="a prorl tree's directory or a git ref of this repository")
    ap.add_argument("--data-mb", type=int, default=400, help="size of the left-out data/ folder")
    ap.add_argument("--git-files", type=int, default=3000, help="small files in the left-out .git folder")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (each tree once per round, alternating)")
    args = ap.parse_args()
    if shutil.which("apptainer") is None or not Path("/bin/busybox").is_file():
        raise SystemExit("needs apptainer and busybox-static (/bin/busybox)")
    print(f"machine: {platform.node()} {platform.platform()}, {os.cpu_count()} CPUs; "
          f"{subprocess.run(['apptainer', '--version'], capture_output=True, text=True).stdout.strip()}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="prorl-bench-context-"))
    try:
        make_context(root, args.data_mb, args.git_files)
        trees = {"this tree": REPO, f"baseline ({args.baseline})": baseline_tree(args.baseline, root)}
        figures: dict[str, dict[str, list[float]]] = {name: {"key_s": [], "build_s": [], "mb": []} for name in trees}
        for n, tree in enumerate(trees.values()):
            # Each tree compiled once: where PYTHONDONTWRITEBYTECODE is set, every run would compile what it imports.
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "prorl_cli")], check=True)
            prorl(tree, root, root / f"cache{n}", "root")  # the base image, once per tree's cache
        for _ in range(args.repeat):
            for n, (name, tree) in enumerate(trees.items()):
                cache = root / f"cache{n}"
                key_s, _ = prorl(tree, root, cache, "--dry-run", "--mode", "lock", "app")
                build_s, results = prorl(tree, root, cache, "--mode", "scratch", "app")
                (app,) = [r for r in results if r["name"] == "app"]
                assert app["action"] == "built", app
                figures[name]["key_s"].append(key_s)
                figures[name]["build_s"].append(build_s)
                figures[name]["mb"].append(Path(str(app["path"])).stat().st_size / 1e6)
                print(f"  {name:24s} lock key {key_s:6.2f} s   build {build_s:7.2f} s   image "
                      f"{figures[name]['mb'][-1]:6.1f} MB", flush=True)
        med = {name: {k: statistics.median(v) for k, v in f.items()} for name, f in figures.items()}
        (this, base) = med.values()
        print(f"\nmedians over {args.repeat} rounds; context: {args.data_mb} MB data/ and {args.git_files} .git files "
              "left out, 50 source files copied")
        for name, m in med.items():
            print(f"{name:24s} lock key {m['key_s']:6.2f} s   build {m['build_s']:7.2f} s   image {m['mb']:6.1f} MB")
        print(f"baseline / this tree:    lock key {base['key_s'] / this['key_s']:5.1f}x   "
              f"build {base['build_s'] / this['build_s']:5.1f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
