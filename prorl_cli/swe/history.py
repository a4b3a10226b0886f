"""The past only: a repository reaches the agent's sandbox holding ``base_commit`` and its ancestors, nothing later.

Two halves. :func:`bundle_base` packs a node-local ``repo_path`` as a git
bundle of ``base_commit``'s history alone (through a throw-away repository
that borrows the objects, so the user's repository is never written to).
:func:`scrub_script` runs inside the sandbox, after the checkout, and makes
the same hold for a repository the image carries (SWE-bench images clone the
whole project): remotes removed; every branch, tag, note or stash that is not
an ancestor of ``base_commit`` deleted; reflogs, ``FETCH_HEAD``/``ORIG_HEAD``,
commit-graph files and alternates gone; the objects repacked and every
unreachable object pruned. Afterwards ``git log --all``, ``git cat-file`` on
a later commit and ``git fsck --lost-found`` find nothing after the base.
"""

from __future__ import annotations

import shlex
import subprocess
import tempfile
from pathlib import Path

from prorl_cli.exceptions import DomainError

BRANCH = "main"


def _git(*args: str, cwd: str | None = None, timeout_s: float = 300.0) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, timeout=timeout_s)
    except subprocess.CalledProcessError as e:
        raise DomainError(f"swe: git {' '.join(args[:3])} failed: {e.stderr.decode(errors='replace')[-500:]}") from e
    except (OSError, subprocess.SubprocessError) as e:
        raise DomainError(f"swe: git {' '.join(args[:3])} failed: {e}") from e
    return done.stdout.decode(errors="replace")


def bundle_base(repo_path: str, base_commit: str, timeout_s: float = 300.0) -> bytes:
    """A git bundle holding ``base_commit`` and its ancestors as branch ``main``, and nothing else."""
    objects = _git("-C", repo_path, "rev-parse", "--path-format=absolute", "--git-path", "objects").strip()
    commit = _git("-C", repo_path, "rev-parse", "--verify", "--end-of-options", f"{base_commit}^{{commit}}").strip()
    with tempfile.TemporaryDirectory(prefix="prorl-swe-bundle-") as tmp:
        _git("init", "-q", "--bare", tmp)
        Path(tmp, "objects", "info", "alternates").write_text(objects + "\n")
        _git("-C", tmp, "update-ref", f"refs/heads/{BRANCH}", commit)
        _git("-C", tmp, "symbolic-ref", "HEAD", f"refs/heads/{BRANCH}")
        try:
            done = subprocess.run(["git", "-C", tmp, "bundle", "create", "-", f"refs/heads/{BRANCH}"],
                                  check=True, capture_output=True, timeout=timeout_s)
        except subprocess.CalledProcessError as e:
            raise DomainError(f"swe: cannot bundle repo_path {repo_path!r} at {base_commit}: "
                              f"{e.stderr.decode(errors='replace')[-500:]}") from e
        except (OSError, subprocess.SubprocessError) as e:
            raise DomainError(f"swe: cannot bundle repo_path {repo_path!r}: {e}") from e
        return done.stdout


def scrub_script(repo_dir: str, base_commit: str) -> str:
    """Bash that leaves the repository at ``repo_dir`` holding nothing later than ``base_commit`` (run after checkout)."""
    repo, base = shlex.quote(repo_dir), shlex.quote(base_commit)
    return f"""set -e
cd {repo}
base=$(git rev-parse --verify {base}^{{commit}})
git -c advice.detachedHead=false checkout -q -f "$base"
for remote in $(git remote); do git remote remove "$remote"; done
git for-each-ref --format='%(refname)' | while IFS= read -r ref; do
  commit=$(git rev-parse -q --verify "$ref^{{commit}}" 2>/dev/null || true)
  if [ -z "$commit" ] || ! git merge-base --is-ancestor "$commit" "$base"; then git update-ref -d "$ref"; fi
done
git stash clear 2>/dev/null || true
git worktree prune 2>/dev/null || true
gitdir=$(git rev-parse --git-dir)
rm -rf "$gitdir/logs" "$gitdir/refs/original" "$gitdir/rr-cache" "$gitdir/FETCH_HEAD" "$gitdir/ORIG_HEAD" \\
  "$gitdir/MERGE_HEAD" "$gitdir/CHERRY_PICK_HEAD" "$gitdir/REVERT_HEAD" "$gitdir/objects/info/commit-graph" \\
  "$gitdir/objects/info/commit-graphs" "$gitdir/objects/pack/multi-pack-index"
find "$gitdir/objects/pack" -name '*.keep' -delete 2>/dev/null || true
git reflog expire --expire=now --expire-unreachable=now --all
git -c repack.writeBitmaps=false repack -a -d -q
rm -f "$gitdir/objects/info/alternates"
git prune --expire=now
"""
