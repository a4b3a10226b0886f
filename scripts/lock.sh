#!/usr/bin/env bash
# Regenerates constraints.txt: installs everything the tests need into a fresh
# venv (scripts/install.sh, without the old constraints) and pins what it got.
# Run it when a dependency changes on purpose; review the diff; commit it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/v"
mv constraints.txt "$tmp/old-constraints.txt" 2>/dev/null || true
if ! PRORL_PYTHON="$tmp/v/bin/python" bash scripts/install.sh; then
  mv "$tmp/old-constraints.txt" constraints.txt 2>/dev/null || true
  exit 1
fi
{
  echo "# The versions CI tested: scripts/install.sh installs with these as pip constraints."
  echo "# Made by scripts/lock.sh from a fresh venv on $(uname -m), Python $("$tmp/v/bin/python" -c 'import platform; print(platform.python_version())')."
  "$tmp/v/bin/python" -m pip freeze --exclude-editable | grep -v '^prorl=='
} >constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) pins"
