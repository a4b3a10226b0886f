"""The image list ``build-images --swe`` writes: groups, per-instance pulls, named problems, stable bytes."""

from __future__ import annotations

from pathlib import Path

import yaml

from prorl_cli.swe.images import plan_dataset
from tests.swe.spacey import make_spacey


def test_plan_groups_by_repo_version_pulls_published_images_and_names_problems(tmp_path: Path) -> None:
    repos = tmp_path / "repos"
    flat = make_spacey(repos / "prorl__spacey")
    rows = [
        {**flat.instance, "install_config": {"pip_packages": "dep-a dep-b", "install": "true"}},
        {**flat.instance, "instance_id": "prorl__spacey-flat-2", "install_config": {"pip_packages": ["dep-a"]}},
        {**flat.instance, "instance_id": "o__published-1", "image": "docker://ns/sweb.eval.x86_64.o_1776_published-1"},
        {**flat.instance, "instance_id": "o__nowhere-1", "repo": "o/nowhere"},
    ]
    recipes = tmp_path / "recipes"
    plan = plan_dataset(rows, recipes, "localimage:/base.sif", None, repos)
    assert plan.names == ["swe-prorl-spacey-0.1", "swe-i-o__published-1"]
    assert plan.repo_images == {"prorl/spacey@0.1": "swe-prorl-spacey-0.1", "o__published-1": "swe-i-o__published-1"}
    assert list(plan.problems) == ["o/nowhere@0.1"] and "no repository" in plan.problems["o/nowhere@0.1"]
    images = yaml.safe_load(plan.images_file.read_text())["images"]
    assert images["swe-i-o__published-1"]["base"] == "docker://ns/sweb.eval.x86_64.o_1776_published-1"
    dockerfile = (recipes / "prorl-spacey-0.1" / "Dockerfile").read_text()
    assert "pip install --no-cache-dir dep-a dep-b" in dockerfile and "RUN cd /testbed && true" in dockerfile
    bundle = (recipes / "prorl-spacey-0.1" / "repo.bundle").read_bytes()
    plan_dataset(rows, recipes, "localimage:/base.sif", None, repos)
    assert (recipes / "prorl-spacey-0.1" / "repo.bundle").read_bytes() == bundle  # same bytes: lock keys hold


def test_images_from_a_registry_namespace_or_a_folder(tmp_path: Path) -> None:
    rows = [{"instance_id": i, "repo": "o/r", "version": "1", "base_commit": "abc", "problem_statement": "",
             "test_patch": "", "FAIL_TO_PASS": [], "PASS_TO_PASS": []} for i in ("o__r-1", "o__r-2", "o__r-3")]
    plan = plan_dataset(rows[:1], tmp_path / "a", "scratch", None, None, images_from="docker://swebench")
    images = yaml.safe_load(plan.images_file.read_text())["images"]
    # SWE-bench's published names: lower case, "__" spelled "_1776_".
    assert images["swe-i-o__r-1"]["base"] == "docker://swebench/sweb.eval.x86_64.o_1776_r-1:latest"
    folder = tmp_path / "sifs"
    folder.mkdir()
    (folder / "o__r-1.sif").write_bytes(b"sif")
    (folder / "o__r-2.tar").write_bytes(b"oci")
    plan = plan_dataset(rows, tmp_path / "b", "scratch", None, None, images_from=str(folder))
    assert plan.names == [] and plan.ready == {"o__r-1": str(folder / "o__r-1.sif")}
    # An archive is converted (tests/images/test_registry.py); this one is no tar at all.
    assert "o__r-2.tar: not a readable tar archive" in plan.problems["o__r-2"]
    assert plan.problems["o__r-3"].startswith("no o__r-3.sif, o__r-3.tar") and str(folder) in plan.problems["o__r-3"]


def test_cli_names_what_is_missing(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    row = {"instance_id": "o__r-1", "repo": "o/r", "version": "1", "base_commit": "abc", "problem_statement": "",
           "test_patch": "", "FAIL_TO_PASS": [], "PASS_TO_PASS": []}
    dataset = tmp_path / "d.json"
    dataset.write_text(json.dumps([row]))

    def prorl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "prorl_cli", "build-images", *args], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)

    alone = prorl("--base", "scratch")
    assert alone.returncode == 1 and "go with --swe DATASET" in alone.stderr
    no_base = prorl("--swe", str(dataset), "--cache-dir", str(tmp_path / "c"))
    assert no_base.returncode == 1 and "give --base" in no_base.stderr
    no_repo = prorl("--swe", str(dataset), "--base", "scratch", "--cache-dir", str(tmp_path / "c"), "--dry-run")
    assert no_repo.returncode == 1 and "o/r@1" in no_repo.stdout and "no repository" in no_repo.stdout


def test_requirements_are_installed_and_one_published_image_serves_its_instances(tmp_path: Path) -> None:
    import json

    from prorl_cli.domains.datasets import load_instances

    repos = tmp_path / "repos"
    flat = make_spacey(repos / "prorl__spacey")
    reqs_a = "attrs==23.1.0\n-e git+https://example.invalid/spacey.git@abc#egg=spacey\nspacey @ file:///testbed\n# pinned\npytest==7.4.0\n"
    rows = [
        {**flat.instance, "requirements": reqs_a, "install_config": {"packages": "requirements.txt", "install": "true"}},
        {**flat.instance, "instance_id": "prorl__spacey-flat-2", "requirements": reqs_a},
        {**flat.instance, "instance_id": "prorl__spacey-flat-3", "requirements": "attrs==22.2.0\n"},
        {**flat.instance, "instance_id": "o__smith-1", "image_name": "jyangballin/swesmith.x86_64.o_1776_r.abc"},
        {**flat.instance, "instance_id": "o__smith-2", "image_name": "jyangballin/swesmith.x86_64.o_1776_r.abc"},
    ]
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_instances("swe", dataset, warn=lambda line: None)  # image_name -> image, as build-images reads it
    plan = plan_dataset(loaded, tmp_path / "recipes", "localimage:/base.sif", None, repos)
    # Two requirements sets for prorl/spacey@0.1: an image each, every instance mapped by its id.
    (a,) = [n for n in plan.names if plan.repo_images["prorl__spacey-flat-1"] == n]
    assert plan.repo_images["prorl__spacey-flat-2"] == a and plan.repo_images["prorl__spacey-flat-3"] != a
    assert "prorl/spacey@0.1" not in plan.repo_images
    folder = tmp_path / "recipes" / a.removeprefix("swe-")
    assert (folder / "requirements.txt").read_text() == "attrs==23.1.0\npytest==7.4.0\n"  # no -e, no file: paths
    dockerfile = (folder / "Dockerfile").read_text()
    assert "COPY requirements.txt /opt/prorl-swe/requirements.txt" in dockerfile
    assert "pip install --no-cache-dir -r /opt/prorl-swe/requirements.txt" in dockerfile
    # SWE-smith's image_name is one image per repository: pulled once, for both instances.
    assert plan.repo_images["o__smith-1"] == plan.repo_images["o__smith-2"]
    images = yaml.safe_load(plan.images_file.read_text())["images"]
    assert images[plan.repo_images["o__smith-1"]]["base"] == "docker://jyangballin/swesmith.x86_64.o_1776_r.abc"
    assert len([n for n in plan.names if n.startswith("swe-i-")]) == 1


def test_cli_reports_the_fields_it_cannot_use_once(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    rows = [{"instance_id": f"o__r-{i}", "repo": "o/r", "version": "1", "base_commit": "abc", "problem_statement": "",
             "test_patch": "", "FAIL_TO_PASS": [], "PASS_TO_PASS": [], "requirements": "attrs==23.1.0\n",
             "environment": "name: testbed\n", "install_config": {"python": "3.9"}} for i in (1, 2)]
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = subprocess.run([sys.executable, "-m", "prorl_cli", "build-images", "--swe", str(dataset), "--base", "scratch",
                           "--cache-dir", str(tmp_path / "c"), "--dry-run"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    lines = [line for line in done.stderr.splitlines() if "SWE-rebench rows: field" in line]
    assert sorted(line.split("field ")[1].split(" ")[0] for line in lines) == ["'environment'", "'install_config.python'"]
    assert all("(2 of 2 row(s)" in line for line in lines)


def test_a_row_without_version_finds_the_image_built_for_it(tmp_path: Path) -> None:
    """build-images keys such a row `repo@latest`; EVAL and validate looked up `repo@None` and fell back to
    the settings' default image, where the repository's tests cannot run."""
    import dataclasses
    from types import SimpleNamespace

    from prorl_cli.handlers.swe_domain import SweHandler
    from prorl_cli.swe.validate_run import image_for

    repos = tmp_path / "repos"
    flat = make_spacey(repos / "prorl__spacey")
    row = {k: v for k, v in flat.instance.items() if k != "version"}
    plan = plan_dataset([row], tmp_path / "recipes", "localimage:/base.sif", None, repos)
    assert plan.repo_images == {"prorl/spacey@latest": "swe-prorl-spacey-latest"}
    assert image_for(row, plan.repo_images) == "swe-prorl-spacey-latest"
    settings = dataclasses.replace(SweHandler.defaults, extra={**SweHandler.defaults.extra,
                                                               "repo_images": plan.repo_images})
    assert SweHandler().image_for(SimpleNamespace(instance=row), settings) == "swe-prorl-spacey-latest"  # type: ignore[arg-type]


def test_a_rows_own_local_image_is_used_as_it_is_or_named_when_missing(tmp_path: Path) -> None:
    repos = tmp_path / "repos"
    flat = make_spacey(repos / "prorl__spacey")
    sif = tmp_path / "mine.sif"
    sif.write_bytes(b"an image")  # what the plan reads of it: that it is there
    rows = [
        {**flat.instance, "instance_id": "o__own-1", "image": str(sif)},
        {**flat.instance, "instance_id": "o__own-2", "image": f"localimage:{sif}"},
        {**flat.instance, "instance_id": "o__gone-1", "image": str(tmp_path / "gone.sif")},
        {**flat.instance, "instance_id": "o__gone-2", "image": f"oci:{tmp_path / 'no-layout'}"},
    ]
    plan = plan_dataset(rows, tmp_path / "recipes", "localimage:/base.sif", None, repos)
    assert plan.ready == {"o__own-1": str(sif), "o__own-2": str(sif)} and plan.names == []
    assert sorted(plan.problems) == ["o__gone-1", "o__gone-2"]
    assert f"{tmp_path / 'gone.sif'} does not exist" in plan.problems["o__gone-1"]
    assert f"{tmp_path / 'no-layout'} does not exist" in plan.problems["o__gone-2"]
