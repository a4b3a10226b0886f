#!/usr/bin/env bash
# bubblewrap (rootless, millisecond sandbox start) and the tools the sandbox
# tests and benchmarks use beside it: tmux (the benchmark baseline),
# busybox-static (the scratch test image), python3 for the unprivileged test
# user (/root/.pyenv is not readable by others), GNU patch (the SWE tests bind
# it into the BusyBox-only domain image: EVAL's fuzzy apply). Debian 12 and 13.
set -euo pipefail
. /etc/os-release
case "${ID}:${VERSION_ID:-}" in
  debian:12|debian:13) ;;
  *) echo "20-bwrap.sh: untested distribution ${PRETTY_NAME:-$ID}; trying anyway" >&2 ;;
esac
export DEBIAN_FRONTEND=noninteractive
need=()
for pkg in bubblewrap tmux busybox-static python3 procps util-linux patch; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || need+=("$pkg")
done
if [ "${#need[@]}" -gt 0 ]; then
  apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
bwrap --version
