#!/usr/bin/env bash
# Installs prorl and everything its tests need into the current Python.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m pip install -q -e ".[test]"
