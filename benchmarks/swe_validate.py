"""``prorl swe validate``: instances validated per hour on this machine, and what bounds it.

``--instances`` copies of the tinycalc instance (distinct ids, the repository
cloned in from this machine, the domain test image already built: local
images) go through ``prorl swe validate`` as a user runs it (its own broker
and node, Apptainer sandboxes), ``--runs`` gold runs and one with the test
patch alone each. Printed: instances/hour, and where a job's time goes from
the jobs' own records: INIT (a sandbox start and the clone), EVAL split into
patch apply, the test run, and the rest (the EVAL sandbox's start, clone and
stop), plus the CPU seconds the whole run took.

The baseline is the same work with no prorl: per run, ``git clone`` the
repository, ``git apply`` the patches and run pytest on the host, one run
after another (no sandbox, no jobs). Its rate is the test work's own bound;
prorl's over it is the price of isolation and scheduling.

``--build-image`` also times ``prorl build-images --swe`` making the
instances' image from the domain image (lock mode: a second run reuses it).

    python benchmarks/swe_validate.py [--instances 8] [--runs 3] [--parallel 4] [--build-image]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from prorl_cli.domains.tinyrepo import make_tinyrepo
from prorl_cli.testing.scripted import TEST_IMAGES


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _prorl(root: Path, *args: str) -> tuple[float, float, subprocess.CompletedProcess[str]]:
    """Run ``prorl --config root/prorl.yaml ARGS``; wall seconds, CPU seconds, the process."""
    env = {k: v for k, v in os.environ.items() if k not in ("PRORL_DEPLOYMENT", "PRORL_CONFIG")}
    env["PRORL_HOME"] = str(root / "home")
    cpu, started = _children_cpu_s(), time.monotonic()
    done = subprocess.run([sys.executable, "-m", "prorl_cli", "--config", str(root / "prorl.yaml"), *args],
                          capture_output=True, text=True, env=env, cwd=root, start_new_session=True, check=False)
    return time.monotonic() - started, _children_cpu_s() - cpu, done


def baseline(rows: list[dict[str, Any]], runs: int, work: Path) -> float:
    """Seconds for the same runs on the host, one after another: clone, apply, pytest."""
    started = time.monotonic()
    for row in rows:
        for k in range(runs + 1):
            repo = work / f"{row['instance_id']}-{k}"
            subprocess.run(["git", "clone", "-q", row["repo_path"], str(repo)], check=True)
            subprocess.run(["git", "-C", str(repo), "checkout", "-q", row["base_commit"]], check=True)
            patches = [row["test_patch"]] + ([row["patch"]] if k < runs else [])
            for n, patch in enumerate(patches):
                (work / f"p{n}.diff").write_text(patch)
                subprocess.run(["git", "-C", str(repo), "apply", str(work / f"p{n}.diff")], check=True)
            files = sorted({t.split("::")[0] for t in row["FAIL_TO_PASS"] + row["PASS_TO_PASS"]})
            subprocess.run([sys.executable, "-m", "pytest", "-rA", "-q", "-p", "no:cacheprovider", *files], cwd=repo,
                           capture_output=True, check=False)
            shutil.rmtree(repo)
    return time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3, help="gold runs per instance")
    ap.add_argument("--parallel", type=int, default=4, help="jobs per stage at once")
    ap.add_argument("--build-image", action="store_true", help="also time build-images --swe for the instances' image")
    args = ap.parse_args()
    image = TEST_IMAGES / "domains.sif"
    if shutil.which("apptainer") is None or not image.is_file():
        sys.exit(f"needs apptainer and {image} (scripts/provision/46-domain-images.sh)")
    with tempfile.TemporaryDirectory(prefix="prorl-bench-validate-") as tmp:
        root = Path(tmp)
        repo = make_tinyrepo(root / "tinycalc")
        rows = [{**repo.instance, "instance_id": f"prorl__tinycalc-{i}", "repo_path": str(repo.path)}
                for i in range(args.instances)]
        (root / "dataset.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / "prorl.yaml").write_text(yaml.safe_dump({
            "sandbox": {"runtime": "apptainer", "image": str(image)}, "handlers": {"swe": {"image": str(image)}},
            "images": {"cache_dir": str(root / "images"), "build_args": ["--mksquashfs-args", "-comp lz4"]}}))
        build_s = None
        if args.build_image:
            build_s, _, built = _prorl(root, "build-images", "--swe", str(root / "dataset.jsonl"),
                                       "--base", f"localimage:{image}", "--map-out", str(root / "repo_images.json"))
            if built.returncode != 0:
                sys.exit(f"build-images --swe failed:\n{built.stdout[-2000:]}{built.stderr[-3000:]}")
        wall_s, cpu_s, done = _prorl(root, "swe", "validate", str(root / "dataset.jsonl"), "--out", str(root / "out"),
                                     "--runs", str(args.runs), "--parallel", str(args.parallel),
                                     *(["--repo-images", str(root / "repo_images.json")] if args.build_image else []))
        if done.returncode != 0:
            sys.exit(f"validate failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
        report = json.loads((root / "out" / "report.json").read_text())
        assert report["counts"]["valid"] == args.instances, report["counts"]
        results = [json.loads(line) for line in (root / "out" / "results.jsonl").read_text().splitlines()]
        reports = [r["output"]["report"] for r in results]
        init_s = statistics.mean(r["stage_s"].get("init", 0.0) for r in results)
        eval_s = statistics.mean(r["stage_s"].get("eval", 0.0) for r in results)
        apply_s = statistics.mean(r["eval_timings"]["apply_s"] for r in reports)
        tests_s = statistics.mean(r["eval_timings"]["run_s"] for r in reports)
        (root / "base").mkdir()
        base_s = baseline(rows, args.runs, root / "base")
    jobs = len(results)
    rate, base_rate = args.instances / wall_s * 3600, args.instances / base_s * 3600
    print(f"\n## prorl swe validate: {args.instances} instances x ({args.runs} gold + 1 test-patch-only) runs, "
          f"pools of {args.parallel}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}\n")
    print("| instances/hour (prorl) | instances/hour (host, one run at a time, no sandbox) | prorl/baseline | "
          "wall s | CPU s | jobs |")
    print("|---|---|---|---|---|---|")
    print(f"| {rate:.0f} | {base_rate:.0f} | {rate / base_rate:.2f}x | {wall_s:.1f} | {cpu_s:.1f} | {jobs} |")
    print("\nper job, mean in-stage seconds:\n")
    print("| INIT (sandbox start, clone) | EVAL | of which: apply | tests | sandbox start, clone, stop | image build s |")
    print("|---|---|---|---|---|---|")
    print(f"| {init_s:.2f} | {eval_s:.2f} | {apply_s:.2f} | {tests_s:.2f} | {eval_s - apply_s - tests_s:.2f} | "
          f"{f'{build_s:.1f}' if build_s is not None else 'local image (not timed)'} |")


if __name__ == "__main__":
    main()
