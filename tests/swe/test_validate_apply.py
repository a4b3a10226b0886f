"""``prorl swe validate`` applies the gold patch as EVAL applies a patch, and builds images from rows read as given.

The gold-patch test runs the command as a user does (a child ``prorl`` starting its own broker and node,
an Apptainer sandbox on the domain test image, the repository cloned in from this machine).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prorl_cli.domains.tinyrepo import make_tinyrepo


def _prorl(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PRORL_DEPLOYMENT", "PRORL_CONFIG")}
    env["PRORL_HOME"] = str(root / "home")
    return subprocess.run([sys.executable, "-m", "prorl_cli", *args], capture_output=True, text=True, timeout=600,
                          env=env, cwd=root, start_new_session=True)


@pytest.mark.apptainer
@pytest.mark.slow
def test_a_gold_patch_that_applies_only_with_fuzz_is_valid_not_gold_fails(tmp_path: Path, domain_image: str) -> None:
    calc = make_tinyrepo(tmp_path / "tinycalc")
    gold = calc.instance["patch"]
    # Made against a file whose lines had moved: the hunk's place and first context line differ, so `git apply`
    # refuses it and only GNU patch with fuzz (EVAL's second try, as swebench's) applies it.
    fuzzy = gold.replace("@@ -3,4 +3,4 @@\n \n", "@@ -6,4 +6,4 @@\n # helpers moved here\n")
    assert fuzzy != gold
    fix = "-    return sum(xs) / (len(xs) - 1)\n+    return sum(xs) / len(xs)\n"
    assert fix in fuzzy
    # SWE-smith's way: the patch that brought the bug in, which the oracle applies reversed (fuzz included).
    bug = fuzzy.replace(fix, "-    return sum(xs) / len(xs)\n+    return sum(xs) / (len(xs) - 1)\n")
    row = {**calc.instance, "repo_path": str(calc.path), "instance_id": "prorl__tinycalc-fuzzy", "patch": fuzzy}
    reverse = {**row, "instance_id": "prorl__tinycalc-fuzzy-reverse", "patch": bug, "patch_reverse": True}
    # A fix taken for a bug-introducing patch (a SWE-bench row read with --format swe-smith): refused, saying so.
    wrongly = {**row, "instance_id": "prorl__tinycalc-wrongly-reversed", "patch": gold, "patch_reverse": True}
    (tmp_path / "dataset.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (row, reverse, wrongly)))
    # SWE-bench's images carry GNU patch; the domain test image has BusyBox's only (no --batch, no --fuzz), so the
    # host's GNU patch (dynamically linked to libc alone) is bound in ahead of it on PATH.
    gnu_patch = shutil.which("patch")
    version = subprocess.run([gnu_patch, "--version"], capture_output=True, text=True).stdout if gnu_patch else ""
    if not version.startswith("GNU patch"):
        pytest.skip("needs GNU patch on this machine")
    (tmp_path / "prorl.yaml").write_text(yaml.safe_dump({
        "sandbox": {"runtime": "apptainer", "image": domain_image,
                    "extra_args": ["--bind", f"{os.path.realpath(str(gnu_patch))}:/usr/local/bin/patch"]},
        "handlers": {"swe": {"image": domain_image}}}))
    out = tmp_path / "out"
    done = _prorl(tmp_path, "--config", str(tmp_path / "prorl.yaml"), "swe", "validate", str(tmp_path / "dataset.jsonl"),
                  "--out", str(out), "--runs", "1")
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    results = json.loads((out / "report.json").read_text())["results"]
    assert [r["status"] for r in results] == ["valid", "valid", "gold-fails"], json.dumps(results, indent=1)[-6000:]
    assert "the gold patch does not apply reversed (patch_reverse" in results[2]["reason"], results[2]["reason"]
    clean = [json.loads(line) for line in (out / "clean.jsonl").read_text().splitlines()]
    assert [c["instance_id"] for c in clean] == ["prorl__tinycalc-fuzzy", "prorl__tinycalc-fuzzy-reverse"]
    # The fuzzed apply left no backup file for the gold run's diff to carry into the patch EVAL graded.
    saved = [json.loads(line)["output"]["model_patch"] for line in (out / "results.jsonl").read_text().splitlines()
             if json.loads(line)["task"] == "swe_oracle" and json.loads(line)["state"] == "done"]
    assert len(saved) == 2 and all(p.count("diff --git") == 1 and fix in p and ".orig" not in p for p in saved), saved


def test_the_image_build_reads_the_dataset_with_validates_format(tmp_path: Path) -> None:
    # A SWE-smith row that --format auto cannot tell (no image_name, repo not swesmith/...): read as prorl rows,
    # its missing test_patch is an error; as swe-smith it is "" and the images are looked for.
    row = {"instance_id": "o__r.abc-1", "repo": "o/r", "base_commit": "abc", "problem_statement": "p",
           "patch": "diff", "FAIL_TO_PASS": ["t.py::a"], "PASS_TO_PASS": []}
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(json.dumps(row) + "\n")
    sifs = tmp_path / "sifs"
    sifs.mkdir()
    out = tmp_path / "out"
    done = _prorl(tmp_path, "swe", "validate", str(dataset), "--format", "swe-smith", "--images-from", str(sifs),
                  "--out", str(out))
    log = (out / "build-images.log").read_text()
    # No image is there, so validate stops after the build; what the build read is the point.
    assert done.returncode == 1 and "made no repo_images map" in done.stderr, done.stderr
    assert "missing field 'test_patch'" not in log and "no o__r.abc-1.sif" in log, log
    alone = _prorl(tmp_path, "build-images", "--format", "swe-smith")
    assert alone.returncode == 1 and "go with --swe DATASET" in alone.stderr
