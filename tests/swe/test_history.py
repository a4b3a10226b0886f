"""No future in the workspace: the base-only bundle of a ``repo_path``, and the in-place scrub of a repository an image holds.

Run here with this host's git on real repositories; the sandbox test
(tests/swe/test_swe_sandbox.py) asks the same questions from inside Apptainer.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from prorl_cli.swe.history import bundle_base, scrub_script
from tests.swe.spacey import make_spacey


def _git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=check)


def _assert_past_only(repo: Path, base: str, fix: str) -> None:
    commits = _git(repo, "log", "--all", "--format=%H").stdout.split()
    assert fix not in commits and base in commits
    assert _git(repo, "cat-file", "-t", fix, check=False).returncode != 0  # the object itself is gone
    lost = _git(repo, "fsck", "--lost-found")
    assert lost.returncode == 0 and "dangling" not in lost.stdout + lost.stderr
    assert not (repo / ".git" / "lost-found").exists() or not any((repo / ".git" / "lost-found").rglob("*"))
    assert _git(repo, "remote").stdout.strip() == ""
    assert _git(repo, "tag").stdout.strip() == ""  # v1.0 sits on a later commit
    assert _git(repo, "rev-parse", "HEAD").stdout.strip() == base


def test_repo_path_bundle_holds_base_and_its_ancestors_only(tmp_path: Path) -> None:
    repo = make_spacey(tmp_path / "spacey")
    base = repo.instance["base_commit"]
    _git(repo.path, "checkout", "-q", "fix")  # where the node's copy happens to be must not matter
    (tmp_path / "repo.bundle").write_bytes(bundle_base(str(repo.path), base))
    heads = subprocess.run(["git", "bundle", "list-heads", str(tmp_path / "repo.bundle")], capture_output=True,
                           text=True, check=True).stdout
    assert heads.split() == [base, "refs/heads/main"]
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "-b", "main", str(tmp_path / "repo.bundle"), str(clone)], check=True)
    assert repo.fix_commit not in _git(clone, "log", "--all", "--format=%H").stdout
    assert _git(clone, "cat-file", "-t", repo.fix_commit, check=False).returncode != 0
    assert _git(repo.path, "rev-parse", "--abbrev-ref", "HEAD").stdout.strip() == "fix"  # the user's repo untouched


def test_scrub_leaves_an_image_held_clone_with_the_past_only(tmp_path: Path) -> None:
    repo = make_spacey(tmp_path / "spacey")
    base = repo.instance["base_commit"]
    image_repo = tmp_path / "testbed"  # what a SWE-bench image holds: a full clone, remotes and tags included
    subprocess.run(["git", "clone", "-q", str(repo.path), str(image_repo)], check=True)
    _git(image_repo, "fetch", "-q", "--tags", "origin")
    _git(image_repo, "branch", "-q", "future", "origin/fix")
    assert repo.fix_commit in _git(image_repo, "log", "--all", "--format=%H").stdout  # the leak being closed
    done = subprocess.run(["bash", "-c", scrub_script(str(image_repo), base)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    _assert_past_only(image_repo, base, repo.fix_commit)
    assert _git(image_repo, "status", "--porcelain").stdout == ""
