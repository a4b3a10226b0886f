#!/usr/bin/env bash
# Headless Chromium: the HTML report test (`prorl report --html`) opens the page
# in a real browser, checks its console for errors and takes a screenshot.
# Debian 12 and 13 both ship it as the package `chromium`.
set -euo pipefail
. /etc/os-release
case "${ID}:${VERSION_ID:-}" in
  debian:12|debian:13) ;;
  *) echo "60-chromium.sh: untested distribution ${PRETTY_NAME:-$ID}; trying anyway" >&2 ;;
esac
export DEBIAN_FRONTEND=noninteractive
if ! dpkg-query -W -f='${Status}' chromium 2>/dev/null | grep -q "ok installed"; then
  apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core
fi
chromium --version
