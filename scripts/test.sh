#!/usr/bin/env bash
# The README's test command: install everything the tests need, then run them.
#   scripts/test.sh [pytest args...]
# As root it first provisions the real components (scripts/provision.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "$(id -u)" = 0 ]; then
  bash scripts/provision.sh
fi
bash scripts/install.sh
# pytest exits 5 when it collects no test; set -e makes that a failure too.
python3 -m pytest -ra "$@"
