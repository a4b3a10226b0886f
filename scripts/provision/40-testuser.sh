#!/usr/bin/env bash
# An unprivileged user for the rootless sandbox tests, with subordinate uid and
# gid ranges (Apptainer's --fakeroot and user namespaces need them), and a
# range for root too (root's "apptainer build --fakeroot" needs its own line).
set -euo pipefail
. /etc/os-release
USER_NAME=prorl-test
if ! id -u "$USER_NAME" >/dev/null 2>&1; then
  useradd --create-home --shell /bin/bash "$USER_NAME"
fi
add_range() {  # file user start
  local file=$1 user=$2 start=$3
  touch "$file"
  grep -q "^${user}:" "$file" || echo "${user}:${start}:65536" >>"$file"
}
for f in /etc/subuid /etc/subgid; do
  add_range "$f" root 1000000
  add_range "$f" "$USER_NAME" 2000000
done
# Unprivileged user namespaces must be allowed (bubblewrap and Apptainer need them).
if [ -r /proc/sys/kernel/unprivileged_userns_clone ] && [ "$(cat /proc/sys/kernel/unprivileged_userns_clone)" = 0 ]; then
  sysctl -w kernel.unprivileged_userns_clone=1
fi
runuser -u "$USER_NAME" -- bwrap --ro-bind / / --dev /dev --proc /proc --unshare-all --uid 0 true
echo "test user $USER_NAME ready (uid $(id -u "$USER_NAME"))"
