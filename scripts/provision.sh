#!/usr/bin/env bash
# Installs and starts the real components the tests use (run as root; the
# README's test command calls it). Each piece is a script in scripts/provision/,
# run in name order; each one is idempotent and reads /etc/os-release itself.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ "$(id -u)" != 0 ]; then
  echo "provision.sh: must run as root (skipping: tests needing missing components will skip or, under PRORL_REQUIRE_ALL=1, fail)" >&2
  exit 0
fi
for step in "$here"/provision/[0-9]*.sh; do
  [ -e "$step" ] || continue
  echo "== provision: $(basename "$step")"
  bash "$step"
done
