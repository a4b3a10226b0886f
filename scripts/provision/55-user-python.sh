#!/usr/bin/env bash
# A Python for unprivileged users with prorl's core dependencies, in a
# world-readable place: tests/slurm/test_nonroot.py runs `prorl launch`,
# `submit` and `down` as the test user (40-testuser.sh), whose Slurm jobs run
# as that user too. Root's interpreter may be unreadable to them (a pyenv under
# /root, mode 0700: SLURM-FACTS.md), so this builds a venv from /usr/bin/python3.
# prorl itself is not installed here: the tests put a readable tree on PYTHONPATH.
#
# Idempotent: rebuilds only when the venv is missing or lacks a dependency.
# Root only. PRORL_USER_VENV (default /opt/prorl-venv) says where.
set -euo pipefail
if [ "$(id -u)" != 0 ]; then
  echo "55-user-python.sh: must run as root" >&2
  exit 1
fi
VENV=${PRORL_USER_VENV:-/opt/prorl-venv}
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# The core dependencies, read from pyproject.toml (one source of truth).
mapfile -t DEPS < <(/usr/bin/python3 - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
PY
)
check='import click, submitit, spython, zmq, msgpack, transformers, yaml, rich, jinja2'
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$check" 2>/dev/null; then
  echo "user python ready: $VENV/bin/python"
  exit 0
fi
if ! /usr/bin/python3 -m venv --help >/dev/null 2>&1; then
  apt-get -o DPkg::Lock::Timeout=900 install -y --no-install-recommends python3-venv
fi
/usr/bin/python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "${DEPS[@]}"
chmod -R a+rX "$VENV"
"$VENV/bin/python" -c "$check"
echo "user python ready: $VENV/bin/python"
