#!/usr/bin/env bash
# The README's first command, exactly as written, where a newcomer runs it:
#   python3 -m pip install -e ".[cpu]" && prorl quickstart
# in a fresh copy of this checkout, in a fresh venv, with PRORL_HOME set to a
# folder of the user's own, and not as root: as root this runs it as the
# provisioned unprivileged user (scripts/provision/40-testuser.sh, prorl-test),
# with that user's own Python (/usr/bin/python3) and pip settings; otherwise as
# the current user. Exits with the quickstart's status and checks its summary.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
user="${PRORL_NEWCOMER:-prorl-test}"
work="$(mktemp -d "${TMPDIR:-/tmp}/prorl-newcomer.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# Tracked files only: what a clone has (the handlers link included).
git ls-files -z | tar --null -T - -cf - | tar -C "$work" -xf -
mkdir -p "$work/home"
# pip's local wheel folder (torch's CPU build on this kind of machine), if the machine has one.
find_links="${PIP_FIND_LINKS:-}"
[ -z "$find_links" ] && [ -d /opt/wheels ] && find_links=/opt/wheels
script='set -euo pipefail
cd "$1"
/usr/bin/env python3 -m venv .venv
. .venv/bin/activate
python3 -m pip install -q -e ".[cpu]" && PRORL_HOME="$1/home" prorl quickstart
python3 - <<PY
import json
s = json.load(open("prorl-quickstart/summary.json"))
assert s["task"] == "math_agent" and s["jobs"] > 0 and s["states"].get("done", 0) > 0, s
print("newcomer: quickstart ran", s["jobs"], "jobs:", s["states"])
PY'
if [ "$(id -u)" = 0 ]; then
  if ! id -u "$user" >/dev/null 2>&1; then
    echo "newcomer.sh: user $user missing (scripts/provision.sh makes it)" >&2
    exit 1
  fi
  chown -R "$user:" "$work"
  chmod 755 "$work"
  home_dir="$(getent passwd "$user" | cut -d: -f6)"
  runuser -u "$user" -- env -i HOME="$home_dir" USER="$user" LANG=C.UTF-8 PATH=/usr/local/bin:/usr/bin:/bin \
    ${find_links:+PIP_FIND_LINKS="$find_links"} PIP_DISABLE_PIP_VERSION_CHECK=1 \
    bash -c "$script" newcomer "$work"
else
  bash -c "$script" newcomer "$work"
fi
